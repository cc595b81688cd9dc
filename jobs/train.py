"""Entry point for clusters: `ray job submit --working-dir . -- python jobs/train.py --config jobs/configs/toy.yaml`.

Under `ray job submit` the driver joins the running cluster (RAY_ADDRESS is set); run directly it
starts a private local Ray, exactly like `gyre-ray train`. `python jobs/train.py --resume RUN_DIR
[run.steps=N]` continues a run from its newest checkpoint; `python jobs/train.py --attach RUN_DIR`
takes over a run whose driver died on the cluster (docs/faults.md).
"""

import sys

from gyre_ray.cli import main

if __name__ == "__main__":
    sys.exit(main(["train", *sys.argv[1:]]))
