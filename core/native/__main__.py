"""``python -m conveyor.native``: build the CPU kernels now; exit 1 where they cannot be built."""

import logging

from conveyor import native

logging.basicConfig(level=logging.INFO, format="%(message)s")
ok = native.load()
print(f"CPU kernels {'ready' if ok else 'unavailable; torch ops will be used'}: {native.cache_dir()}")
raise SystemExit(0 if ok else 1)
