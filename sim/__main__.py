"""``python -m pdctl.sim <SGLang 0.5.23 launch_server flags>``: the GPU-free stand-in for
``python -m sglang.launch_server`` (see ``pdctl.sim.server``)."""

import sys

from .server import main

if __name__ == "__main__":
    sys.exit(main())
