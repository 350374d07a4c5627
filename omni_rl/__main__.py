"""``python -m omni_rl`` runs the CLI; torchrun launches it this way:
``torchrun --nproc-per-node=N -m omni_rl train CONFIG``."""

import sys

from omni_rl.cli import main

sys.exit(main())
