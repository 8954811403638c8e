"""A toy classification set: interleaved noisy spirals in the plane, one arm per class."""

import numpy as np


def spirals(
    per_class: int, classes: int, rng: np.random.Generator, noise: float = 0.2
) -> tuple[np.ndarray, np.ndarray]:
    """Points (classes * per_class, 2) float64 and their labels (classes * per_class,) int64."""
    if per_class < 1 or classes < 2:
        raise ValueError("need at least one point per class and two classes")
    radius = np.tile(np.linspace(0.05, 1.0, per_class), classes)
    labels = np.repeat(np.arange(classes), per_class)
    angle = labels * 2 * np.pi / classes + radius * 4 + rng.normal(0, noise, radius.shape)
    points = np.stack([radius * np.sin(angle), radius * np.cos(angle)], axis=1)
    return points, labels.astype(np.int64)
