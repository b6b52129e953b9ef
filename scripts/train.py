"""Script form of ``python -m ds_mtraining.train`` for launchers given a script path:

    deepspeed --num_gpus 2 scripts/train.py --deepspeed_config ds_configs/cpu_demo.json
"""
import sys
from pathlib import Path

try:
    import ds_mtraining  # noqa: F401  (installed with pip)
except ModuleNotFoundError:  # a source checkout: the repository root holds the package
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from ds_mtraining.train import main

if __name__ == "__main__":
    main()
