// One pass of Adam(W) over a host-resident chunk shard: gradient in, fp32 master and moments updated,
// the compute-dtype copy of the new master written out, all in the same loop on all cores.
//
// Why a kernel of our own: DeepSpeed's cpu_adam op steps (params, grads) of one dtype with fp32 or
// same-dtype moments, and leaves the cast into the compute copy to a second pass over the master. The
// offloaded step is memory bound (bytes, not flops), so every pass it saves is time; and bf16 moments beside
// an fp32 master (6 bytes/param less host RAM) are not among its combinations.
//
// The update is torch.optim.Adam / AdamW's formula (their fused CPU kernel's order) in fp32 for every element,
// with the bias correction of v applied as DeepSpeed's op does, by one multiply:
//   p *= 1 - lr*wd (AdamW) | g += wd*p (Adam)
//   m = lerp(m, g, 1-b1);  v = b2*v + (1-b2)*g*g
//   p -= (lr / (1-b1^t)) * m / (sqrt(v) * (1 / sqrt(1-b2^t)) + eps)
// bf16 moments are rounded stochastically: round-to-nearest would freeze v, whose per-step relative change
// (1-b2 = 0.001) is below bf16's half ulp (0.002). The random bits are a hash of (seed, element index), so a
// step is deterministic and a resumed run repeats it bit for bit.
#include <torch/extension.h>
#include <ATen/Parallel.h>

#if defined(__AVX__)
#include <immintrin.h>
#endif

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>
#include <type_traits>

namespace {

inline uint32_t bits_of(float x) { uint32_t u; std::memcpy(&u, &x, 4); return u; }
inline float float_of(uint32_t u) { float x; std::memcpy(&x, &u, 4); return x; }

inline float load(const float* p, int64_t i) { return p[i]; }
inline float load(const at::BFloat16* p, int64_t i) {
  uint16_t h; std::memcpy(&h, p + i, 2); return float_of(static_cast<uint32_t>(h) << 16);
}

// Round to nearest even; NaN stays NaN (a quiet one).
inline uint16_t bf16_nearest(float x) {
  uint32_t u = bits_of(x);
  if ((u & 0x7fffffffu) > 0x7f800000u) return static_cast<uint16_t>((u >> 16) | 0x40u);
  return static_cast<uint16_t>((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
}

// Add 16 random bits below the kept ones, then truncate: unbiased, E[round(x)] = x.
inline uint16_t bf16_stochastic(float x, uint32_t random16) {
  uint32_t u = bits_of(x);
  if ((u & 0x7f800000u) == 0x7f800000u) return bf16_nearest(x);  // inf/nan: no noise
  return static_cast<uint16_t>((u + (random16 & 0xffffu)) >> 16);
}

// murmur3's 32-bit finaliser: a cheap, well-mixed hash of the element index and the step's seed.
inline uint32_t mix(uint32_t h) {
  h ^= h >> 16; h *= 0x85ebca6bu; h ^= h >> 13; h *= 0xc2b2ae35u; h ^= h >> 16; return h;
}

inline void store(float* p, int64_t i, float x, uint32_t) { p[i] = x; }
inline void store(at::BFloat16* p, int64_t i, float x, uint32_t random16) {
  uint16_t h = bf16_stochastic(x, random16); std::memcpy(p + i, &h, 2);
}

struct Hyper {
  float lr, beta1, beta2, eps, weight_decay, step_size, bias_correction2_rsqrt, grad_scale;
  bool adamw;
  uint32_t seed;
};

// Where a step reads the master and moments it updates: null for the arrays it writes (in place), or another set
// of the same sizes (a speculative step, zerogpt/zero/host_step.py: it writes the spare set, and the state it
// read stays as it was until the step is validated). Never the arrays written: those are __restrict__.
template <typename S>
struct Source {
  const float* master = nullptr;
  const S* exp_avg = nullptr;
  const S* exp_avg_sq = nullptr;
};

// Elements [0, n) of the arrays, which are elements [first, first + n) of the shard (the hash's index).
// `Separate`: read the master and moments from `src` (offset like the written arrays), else from those arrays.
template <typename G, typename S, typename O, bool Separate>
inline void adam_elements(float* __restrict__ master, const G* __restrict__ grad, S* __restrict__ exp_avg,
                          S* __restrict__ exp_avg_sq, O* __restrict__ out, Source<S> src, int64_t first, int64_t n,
                          const Hyper& h) {
  const float* master_in = Separate ? src.master : master;
  const S* exp_avg_in = Separate ? src.exp_avg : exp_avg;
  const S* exp_avg_sq_in = Separate ? src.exp_avg_sq : exp_avg_sq;
  // locals, not h's fields: the compiler can't prove the stores below don't alias a float inside `h`
  const float beta1 = h.beta1, beta2 = h.beta2, eps = h.eps, step_size = h.step_size;
  const float bc2_rsqrt = h.bias_correction2_rsqrt, grad_scale = h.grad_scale;
  const float decay = h.adamw ? 1.0f - h.lr * h.weight_decay : 1.0f;  // AdamW: p *= decay
  const float l2 = h.adamw ? 0.0f : h.weight_decay;  // Adam: g += l2 * p
  const uint32_t seed = h.seed;
  for (int64_t k = 0; k < n; ++k) {
    float p = master_in[k] * decay;
    float g = load(grad, k) * grad_scale + l2 * master_in[k];
    float m = load(exp_avg_in, k);
    float v = load(exp_avg_sq_in, k);
    m = m + (1.0f - beta1) * (g - m);
    v = beta2 * v + (1.0f - beta2) * g * g;
    // one division per element, as DeepSpeed's op: sqrt(v / bc2) = sqrt(v) * (1 / sqrt(bc2)). Where the
    // loop runs from cache (small shards, a fast memory bus) a second division cost ~8%.
    p -= step_size * m / (std::sqrt(v) * bc2_rsqrt + eps);
    master[k] = p;
    uint32_t random = mix(static_cast<uint32_t>(first + k) * 0x9e3779b9u ^ seed);
    store(exp_avg, k, m, random);
    store(exp_avg_sq, k, v, random >> 16);
    if constexpr (std::is_same_v<O, float>) {
      out[k] = p;
    } else if constexpr (std::is_same_v<O, at::BFloat16>) {
      uint16_t b = bf16_nearest(p); std::memcpy(out + k, &b, 2);
    }
  }
}

// The compute copy is written and never read here, so it is written with streaming stores: a plain store first
// reads each line it fills into the cache, 2 more bytes per parameter over the memory bus for a bf16 copy (32
// instead of 30 bytes, of DeepSpeed's op's 28). Whole cache lines only: the elements before the first aligned
// line and after the last whole block are stored plainly.
constexpr int64_t kLine = 64;
constexpr int64_t kBlockBytes = 4 * kLine;

template <typename O>
inline void stream_block(O* dst, const O* src) {
#if defined(__AVX__)
  for (int64_t b = 0; b < kBlockBytes; b += 32) {
    _mm256_stream_si256(reinterpret_cast<__m256i*>(reinterpret_cast<char*>(dst) + b),
                        _mm256_load_si256(reinterpret_cast<const __m256i*>(reinterpret_cast<const char*>(src) + b)));
  }
#else
  std::memcpy(dst, src, kBlockBytes);
#endif
}

template <typename G, typename S, typename O, bool Separate>
void adam_range(float* master, const G* grad, S* exp_avg, S* exp_avg_sq, O* out, Source<S> src, int64_t begin,
                int64_t end, const Hyper& h) {
  auto elements = [&](O* o, int64_t from, int64_t n) {
    Source<S> at = Separate ? Source<S>{src.master + from, src.exp_avg + from, src.exp_avg_sq + from} : src;
    adam_elements<G, S, O, Separate>(master + from, grad + from, exp_avg + from, exp_avg_sq + from, o, at, from, n,
                                     h);
  };
  if constexpr (std::is_void_v<O>) {
    elements(nullptr, begin, end - begin);
  } else {
    constexpr int64_t size = sizeof(O), block = kBlockBytes / size;
    const int64_t misaligned = static_cast<int64_t>(reinterpret_cast<uintptr_t>(out + begin) % kLine) / size;
    int64_t i = std::min(end, begin + (misaligned ? kLine / size - misaligned : 0));
    if (reinterpret_cast<uintptr_t>(out) % size) i = end;  // not element-aligned: plain stores throughout
    elements(out + begin, begin, i - begin);
    alignas(kLine) O buffer[block];
    for (; i + block <= end; i += block) {
      elements(buffer, i, block);
      stream_block(out + i, buffer);
    }
    elements(out + i, i, end - i);
#if defined(__AVX__)
    _mm_sfence();  // streaming stores are weakly ordered: make them visible before the caller reads `out`
#endif
  }
}

// A run of elements that all take weight decay or all do not (biases, norms): the engine steps a chunk shard
// of many params in one call, so the fork and the Python call are paid once per chunk, not once per run.
struct Segment {
  int64_t begin, end;
  bool decays;
};

// The segments that cover [0, n), from the sorted ranges that decay (begin0, end0, begin1, end1, ...).
std::vector<Segment> segments_of(int64_t n, const c10::optional<std::vector<int64_t>>& decay_ranges) {
  if (!decay_ranges.has_value()) return {{0, n, true}};
  const std::vector<int64_t>& r = *decay_ranges;
  TORCH_CHECK(r.size() % 2 == 0, "host_adam: decay_ranges must hold (begin, end) pairs, got ", r.size(), " numbers");
  std::vector<Segment> segments;
  int64_t at = 0;
  for (size_t k = 0; k < r.size(); k += 2) {
    TORCH_CHECK(at <= r[k] && r[k] <= r[k + 1] && r[k + 1] <= n, "host_adam: decay range (", r[k], ", ", r[k + 1],
                ") is not sorted, disjoint and within the ", n, " elements");
    if (at < r[k]) segments.push_back({at, r[k], false});
    if (r[k] < r[k + 1]) segments.push_back({r[k], r[k + 1], true});
    at = r[k + 1];
  }
  if (at < n) segments.push_back({at, n, false});
  return segments;
}

template <typename G, typename S, typename O, bool Separate>
void run_from(torch::Tensor& master, const torch::Tensor& grad, torch::Tensor& exp_avg, torch::Tensor& exp_avg_sq,
              O* out, Source<S> src, const std::vector<Segment>& segments, const Hyper& decaying,
              const Hyper& not_decaying) {
  float* p = master.data_ptr<float>();
  const G* g = grad.data_ptr<G>();
  S* m = exp_avg.data_ptr<S>();
  S* v = exp_avg_sq.data_ptr<S>();
  // 64k elements per task: large enough to amortise the fork, small enough to balance the cores
  at::parallel_for(0, master.numel(), 1 << 16, [&](int64_t begin, int64_t end) {
    auto seg = std::upper_bound(segments.begin(), segments.end(), begin,
                                [](int64_t i, const Segment& s) { return i < s.end; });
    for (; seg != segments.end() && seg->begin < end; ++seg) {
      adam_range<G, S, O, Separate>(p, g, m, v, out, src, std::max(begin, seg->begin), std::min(end, seg->end),
                                    seg->decays ? decaying : not_decaying);
    }
  });
}

// The master and moments as they were before this step: the spare set's source, or none (in place).
struct Sources {
  c10::optional<torch::Tensor> master, exp_avg, exp_avg_sq;
  bool given() const { return master.has_value(); }
};

template <typename G, typename S, typename O>
void run(torch::Tensor& master, const torch::Tensor& grad, torch::Tensor& exp_avg, torch::Tensor& exp_avg_sq,
         O* out, const Sources& from, const std::vector<Segment>& segments, const Hyper& decaying,
         const Hyper& not_decaying) {
  if (!from.given()) {
    run_from<G, S, O, false>(master, grad, exp_avg, exp_avg_sq, out, Source<S>{}, segments, decaying, not_decaying);
    return;
  }
  Source<S> src{from.master->data_ptr<float>(), from.exp_avg->data_ptr<S>(), from.exp_avg_sq->data_ptr<S>()};
  run_from<G, S, O, true>(master, grad, exp_avg, exp_avg_sq, out, src, segments, decaying, not_decaying);
}

template <typename G, typename S>
void dispatch_out(torch::Tensor& master, const torch::Tensor& grad, torch::Tensor& exp_avg,
                  torch::Tensor& exp_avg_sq, c10::optional<torch::Tensor>& out, const Sources& from,
                  const std::vector<Segment>& segments, const Hyper& decaying, const Hyper& not_decaying) {
  if (!out.has_value()) {
    run<G, S, void>(master, grad, exp_avg, exp_avg_sq, static_cast<void*>(nullptr), from, segments, decaying,
                    not_decaying);
  } else if (out->scalar_type() == at::kBFloat16) {
    run<G, S, at::BFloat16>(master, grad, exp_avg, exp_avg_sq, out->data_ptr<at::BFloat16>(), from, segments,
                            decaying, not_decaying);
  } else {
    run<G, S, float>(master, grad, exp_avg, exp_avg_sq, out->data_ptr<float>(), from, segments, decaying,
                     not_decaying);
  }
}

template <typename G>
void dispatch_state(torch::Tensor& master, const torch::Tensor& grad, torch::Tensor& exp_avg,
                    torch::Tensor& exp_avg_sq, c10::optional<torch::Tensor>& out, const Sources& from,
                    const std::vector<Segment>& segments, const Hyper& decaying, const Hyper& not_decaying) {
  if (exp_avg.scalar_type() == at::kBFloat16) {
    dispatch_out<G, at::BFloat16>(master, grad, exp_avg, exp_avg_sq, out, from, segments, decaying, not_decaying);
  } else {
    dispatch_out<G, float>(master, grad, exp_avg, exp_avg_sq, out, from, segments, decaying, not_decaying);
  }
}

void check(const torch::Tensor& t, const char* name, int64_t numel, std::initializer_list<at::ScalarType> dtypes) {
  TORCH_CHECK(t.device().is_cpu(), "host_adam: ", name, " must be on the CPU, got ", t.device());
  TORCH_CHECK(t.is_contiguous(), "host_adam: ", name, " must be contiguous");
  TORCH_CHECK(t.numel() == numel, "host_adam: ", name, " has ", t.numel(), " elements, the master ", numel);
  bool ok = false;
  for (auto d : dtypes) ok = ok || t.scalar_type() == d;
  TORCH_CHECK(ok, "host_adam: ", name, " has dtype ", t.scalar_type(), ", not one this kernel takes");
}

}  // namespace

// `step` is the step count after this update (1 on the first step); `grad_scale` multiplies the gradient as it
// is read (unscale and clip in the same pass); `decay_ranges` (begin0, end0, begin1, ...), when given, are the
// only elements that take weight decay. `from_master`, `from_exp_avg`, `from_exp_avg_sq` (all or none): the state
// the update starts from, left unchanged; master and moments then only receive the result.
void adam_step(torch::Tensor master, torch::Tensor grad, torch::Tensor exp_avg, torch::Tensor exp_avg_sq,
               c10::optional<torch::Tensor> out, int64_t step, double lr, double beta1, double beta2, double eps,
               double weight_decay, bool adamw, bool bias_correction, double grad_scale, int64_t seed,
               c10::optional<std::vector<int64_t>> decay_ranges, c10::optional<torch::Tensor> from_master,
               c10::optional<torch::Tensor> from_exp_avg, c10::optional<torch::Tensor> from_exp_avg_sq) {
  const int64_t n = master.numel();
  check(master, "master", n, {at::kFloat});
  check(grad, "grad", n, {at::kFloat, at::kBFloat16});
  check(exp_avg, "exp_avg", n, {at::kFloat, at::kBFloat16});
  check(exp_avg_sq, "exp_avg_sq", n, {exp_avg.scalar_type()});
  if (out.has_value()) check(*out, "out", n, {at::kFloat, at::kBFloat16});
  const Sources from{from_master, from_exp_avg, from_exp_avg_sq};
  TORCH_CHECK(from_master.has_value() == from_exp_avg.has_value() && from_master.has_value() ==
              from_exp_avg_sq.has_value(), "host_adam: give all three of from_master, from_exp_avg, from_exp_avg_sq "
              "or none");
  if (from.given()) {
    check(*from.master, "from_master", n, {at::kFloat});
    check(*from.exp_avg, "from_exp_avg", n, {exp_avg.scalar_type()});
    check(*from.exp_avg_sq, "from_exp_avg_sq", n, {exp_avg.scalar_type()});
    for (const torch::Tensor* t : {&master, &exp_avg, &exp_avg_sq}) {  // the kernel writes through __restrict__
      for (const torch::Tensor* f : {&*from.master, &*from.exp_avg, &*from.exp_avg_sq}) {
        TORCH_CHECK(t->data_ptr() != f->data_ptr(), "host_adam: a from_ tensor is also written; step in place "
                    "by giving none");
      }
    }
  }
  TORCH_CHECK(step >= 1, "host_adam: step must be >= 1, got ", step);
  Hyper h;
  h.lr = static_cast<float>(lr);
  h.beta1 = static_cast<float>(beta1);
  h.beta2 = static_cast<float>(beta2);
  h.eps = static_cast<float>(eps);
  h.weight_decay = static_cast<float>(weight_decay);
  h.adamw = adamw;
  h.grad_scale = static_cast<float>(grad_scale);
  const double bc1 = bias_correction ? 1.0 - std::pow(beta1, static_cast<double>(step)) : 1.0;
  const double bc2 = bias_correction ? 1.0 - std::pow(beta2, static_cast<double>(step)) : 1.0;
  h.step_size = static_cast<float>(lr / bc1);
  h.bias_correction2_rsqrt = static_cast<float>(1.0 / std::sqrt(bc2));
  h.seed = mix(static_cast<uint32_t>(seed) ^ mix(static_cast<uint32_t>(step) * 0x27d4eb2fu));
  Hyper not_decaying = h;
  not_decaying.weight_decay = 0.0f;
  const std::vector<Segment> segments = segments_of(n, decay_ranges);
  if (grad.scalar_type() == at::kBFloat16) {
    dispatch_state<at::BFloat16>(master, grad, exp_avg, exp_avg_sq, out, from, segments, h, not_decaying);
  } else {
    dispatch_state<float>(master, grad, exp_avg, exp_avg_sq, out, from, segments, h, not_decaying);
  }
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("adam_step", &adam_step, "Fused host Adam(W): fp32 master, fp32|bf16 grad and moments, optional copy out",
        py::arg("master"), py::arg("grad"), py::arg("exp_avg"), py::arg("exp_avg_sq"), py::arg("out"),
        py::arg("step"), py::arg("lr"), py::arg("beta1"), py::arg("beta2"), py::arg("eps"),
        py::arg("weight_decay"), py::arg("adamw"), py::arg("bias_correction"), py::arg("grad_scale"),
        py::arg("seed"), py::arg("decay_ranges"), py::arg("from_master") = py::none(),
        py::arg("from_exp_avg") = py::none(), py::arg("from_exp_avg_sq") = py::none(),
        py::call_guard<py::gil_scoped_release>());
}
