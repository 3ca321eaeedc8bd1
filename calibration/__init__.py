"""MERIT calibration: per-source gradients at θ0, conflict matrix, PCA split."""
