"""Which index torch is installed from: print pip's flags for it, and say on stderr which one and why.

    python3 scripts/torch_index.py https://download.pytorch.org/whl/cpu    # -> --extra-index-url https://...
    python3 scripts/torch_index.py ""                                      # -> nothing: pip's configured index

The Makefile's install step runs it before `pip install torch`. One short probe (a HEAD request, 5 s): on a
machine that reaches only a package mirror, pip would otherwise retry the unreachable index for over a minute
before falling back to the mirror. Standard library only: it runs before anything is installed.
"""
from __future__ import annotations

import argparse
import sys
import time
import urllib.error
import urllib.request


def probe(url: str, timeout_s: float) -> str | None:
    """None when `url` answers within `timeout_s` (any HTTP status counts: the server is there), else why not."""
    request = urllib.request.Request(url.rstrip("/") + "/torch/", method="HEAD")
    try:
        urllib.request.urlopen(request, timeout=timeout_s).close()
    except urllib.error.HTTPError:
        return None
    except (urllib.error.URLError, OSError, ValueError) as e:
        reason = getattr(e, "reason", e)
        return str(reason) or type(reason).__name__
    return None


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("index", help="the extra index URL to try ('' = none: pip's configured index)")
    p.add_argument("--timeout", type=float, default=5.0, help="seconds to wait for an answer")
    args = p.parse_args(argv)
    if not args.index:
        print("torch: from pip's configured index (TORCH_INDEX is empty)", file=sys.stderr)
        return 0
    started = time.monotonic()
    why = probe(args.index, args.timeout)
    if why is None:
        print(f"torch: from {args.index} (it answered in {time.monotonic() - started:.1f} s), "
              f"else pip's configured index", file=sys.stderr)
        print(f"--extra-index-url {args.index}")
    else:
        print(f"torch: {args.index} is out of reach ({why}, {args.timeout:g} s probe); installing torch from pip's "
              f"configured index instead (`pip config list` shows it; set TORCH_INDEX= to skip the probe)",
              file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
