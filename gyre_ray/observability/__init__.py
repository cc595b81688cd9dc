"""Progress display, metrics logging (wandb, offline by default) and run folders."""
