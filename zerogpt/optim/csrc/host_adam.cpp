// One pass of Adam(W) over a host-resident chunk shard: gradient in, fp32 master and moments updated,
// the compute-dtype copy of the new master written out, all in the same loop on all cores.
//
// Why a kernel of our own: DeepSpeed's cpu_adam op steps (params, grads) of one dtype with fp32 or
// same-dtype moments, and leaves the cast into the compute copy to a second pass over the master. The
// offloaded step is memory bound (bytes, not flops), so every pass it saves is time; and bf16 moments beside
// an fp32 master (6 bytes/param less host RAM) are not among its combinations.
//
// The update is torch.optim.Adam / AdamW's (fused CPU kernel) formula, in fp32 for every element:
//   p *= 1 - lr*wd (AdamW) | g += wd*p (Adam)
//   m = lerp(m, g, 1-b1);  v = b2*v + (1-b2)*g*g
//   p -= (lr / (1-b1^t)) * m / (sqrt(v) / sqrt(1-b2^t) + eps)
// bf16 moments are rounded stochastically: round-to-nearest would freeze v, whose per-step relative change
// (1-b2 = 0.001) is below bf16's half ulp (0.002). The random bits are a hash of (seed, element index), so a
// step is deterministic and a resumed run repeats it bit for bit.
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <cmath>
#include <cstdint>
#include <cstring>
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
  float lr, beta1, beta2, eps, weight_decay, step_size, bias_correction2_sqrt, grad_scale;
  bool adamw;
  uint32_t seed;
};

template <typename G, typename S, typename O>
void adam_range(float* __restrict__ master, const G* __restrict__ grad, S* __restrict__ exp_avg,
                S* __restrict__ exp_avg_sq, O* __restrict__ out, int64_t begin, int64_t end, const Hyper h) {
  // locals, not h's fields: the compiler can't prove the stores below don't alias a float inside `h`
  const float beta1 = h.beta1, beta2 = h.beta2, eps = h.eps, step_size = h.step_size;
  const float bc2_sqrt = h.bias_correction2_sqrt, grad_scale = h.grad_scale;
  const float decay = h.adamw ? 1.0f - h.lr * h.weight_decay : 1.0f;  // AdamW: p *= decay
  const float l2 = h.adamw ? 0.0f : h.weight_decay;  // Adam: g += l2 * p
  const uint32_t seed = h.seed;
  for (int64_t i = begin; i < end; ++i) {
    float p = master[i] * decay;
    float g = load(grad, i) * grad_scale + l2 * master[i];
    float m = load(exp_avg, i);
    float v = load(exp_avg_sq, i);
    m = m + (1.0f - beta1) * (g - m);
    v = beta2 * v + (1.0f - beta2) * g * g;
    p -= step_size * m / (std::sqrt(v) / bc2_sqrt + eps);
    master[i] = p;
    uint32_t random = mix(static_cast<uint32_t>(i) * 0x9e3779b9u ^ seed);
    store(exp_avg, i, m, random);
    store(exp_avg_sq, i, v, random >> 16);
    if constexpr (std::is_same_v<O, float>) {
      out[i] = p;
    } else if constexpr (std::is_same_v<O, at::BFloat16>) {
      uint16_t b = bf16_nearest(p); std::memcpy(out + i, &b, 2);
    }
  }
}

template <typename G, typename S, typename O>
void run(torch::Tensor& master, const torch::Tensor& grad, torch::Tensor& exp_avg, torch::Tensor& exp_avg_sq,
         O* out, const Hyper& h) {
  float* p = master.data_ptr<float>();
  const G* g = grad.data_ptr<G>();
  S* m = exp_avg.data_ptr<S>();
  S* v = exp_avg_sq.data_ptr<S>();
  // 64k elements per task: large enough to amortise the fork, small enough to balance the cores
  at::parallel_for(0, master.numel(), 1 << 16, [&](int64_t begin, int64_t end) {
    adam_range<G, S, O>(p, g, m, v, out, begin, end, h);
  });
}

template <typename G, typename S>
void dispatch_out(torch::Tensor& master, const torch::Tensor& grad, torch::Tensor& exp_avg,
                  torch::Tensor& exp_avg_sq, c10::optional<torch::Tensor>& out, const Hyper& h) {
  if (!out.has_value()) {
    run<G, S, void>(master, grad, exp_avg, exp_avg_sq, static_cast<void*>(nullptr), h);
  } else if (out->scalar_type() == at::kBFloat16) {
    run<G, S, at::BFloat16>(master, grad, exp_avg, exp_avg_sq, out->data_ptr<at::BFloat16>(), h);
  } else {
    run<G, S, float>(master, grad, exp_avg, exp_avg_sq, out->data_ptr<float>(), h);
  }
}

template <typename G>
void dispatch_state(torch::Tensor& master, const torch::Tensor& grad, torch::Tensor& exp_avg,
                    torch::Tensor& exp_avg_sq, c10::optional<torch::Tensor>& out, const Hyper& h) {
  if (exp_avg.scalar_type() == at::kBFloat16) dispatch_out<G, at::BFloat16>(master, grad, exp_avg, exp_avg_sq, out, h);
  else dispatch_out<G, float>(master, grad, exp_avg, exp_avg_sq, out, h);
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
// is read (unscale and clip in the same pass).
void adam_step(torch::Tensor master, torch::Tensor grad, torch::Tensor exp_avg, torch::Tensor exp_avg_sq,
               c10::optional<torch::Tensor> out, int64_t step, double lr, double beta1, double beta2, double eps,
               double weight_decay, bool adamw, bool bias_correction, double grad_scale, int64_t seed) {
  const int64_t n = master.numel();
  check(master, "master", n, {at::kFloat});
  check(grad, "grad", n, {at::kFloat, at::kBFloat16});
  check(exp_avg, "exp_avg", n, {at::kFloat, at::kBFloat16});
  check(exp_avg_sq, "exp_avg_sq", n, {exp_avg.scalar_type()});
  if (out.has_value()) check(*out, "out", n, {at::kFloat, at::kBFloat16});
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
  h.bias_correction2_sqrt = static_cast<float>(std::sqrt(bc2));
  h.seed = mix(static_cast<uint32_t>(seed) ^ mix(static_cast<uint32_t>(step) * 0x27d4eb2fu));
  if (grad.scalar_type() == at::kBFloat16) dispatch_state<at::BFloat16>(master, grad, exp_avg, exp_avg_sq, out, h);
  else dispatch_state<float>(master, grad, exp_avg, exp_avg_sq, out, h);
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("adam_step", &adam_step, "Fused host Adam(W): fp32 master, fp32|bf16 grad and moments, optional copy out",
        py::arg("master"), py::arg("grad"), py::arg("exp_avg"), py::arg("exp_avg_sq"), py::arg("out"),
        py::arg("step"), py::arg("lr"), py::arg("beta1"), py::arg("beta2"), py::arg("eps"),
        py::arg("weight_decay"), py::arg("adamw"), py::arg("bias_correction"), py::arg("grad_scale"),
        py::arg("seed"), py::call_guard<py::gil_scoped_release>());
}
