"""Floor 4, measurement: real runs on this machine with the exact tracker (`runs`, the torchrun worker and its
launcher) and `validate`, which re-predicts every measured row against the tolerances stated in `tolerances`."""
