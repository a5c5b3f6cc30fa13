"""t-SNE (van der Maaten and Hinton, 2008) in numpy: exact gradient, for maps of up to ~1500 points.

Gaussian input affinities calibrated per point to a target perplexity by bisection, Student-t affinities in the
map, early exaggeration, momentum and per-parameter gains. Deterministic for a given seed."""

from __future__ import annotations

import logging

import numpy as np

log = logging.getLogger(__name__)

MAX_POINTS = 5000  # exact t-SNE holds five n×n float64 matrices: 5000 points is ~1 GB


def standardize(features: np.ndarray) -> np.ndarray:
    """Zero mean and unit variance per column, so that no feature dominates the distances by its scale alone;
    constant columns become zeros."""
    x = np.asarray(features, dtype=np.float64)
    std = x.std(axis=0)
    return (x - x.mean(axis=0)) / np.where(std > 0, std, 1.0)


def _squared_distances(x: np.ndarray) -> np.ndarray:
    norms = np.einsum("ij,ij->i", x, x)
    d = x @ x.T  # [n, n], updated in place: no second n×n temporary
    d *= -2.0
    d += norms[:, None]
    d += norms[None, :]
    np.fill_diagonal(d, 0.0)
    return np.maximum(d, 0.0, out=d)  # rounding can make tiny negatives


def _row_affinities(d: np.ndarray, beta: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Conditional p_{j|i} for precisions `beta` [n] and their entropies H_i (nats); `d` has +inf on the diagonal.

    Distances are shifted by their row minimum first (avoids every exp underflowing for a large beta); the shift
    cancels in both p and H = log Z + beta * E_p[d]."""
    shifted = d - d.min(axis=1, keepdims=True)
    unnormalized = np.exp(-shifted * beta[:, None])  # the diagonal's inf gives 0
    z = unnormalized.sum(axis=1)
    p = unnormalized / z[:, None]
    mean_distance = (p * np.where(np.isfinite(shifted), shifted, 0.0)).sum(axis=1)
    return p, np.log(z) + beta * mean_distance


def input_affinities(x: np.ndarray, perplexity: float, tol: float = 1e-5, steps: int = 100) -> np.ndarray:
    """Symmetric joint affinities P [n, n] (sum 1): each row's Gaussian precision is bisected, all rows at once,
    until the row's perplexity exp(H) equals `perplexity`."""
    n = x.shape[0]
    d = _squared_distances(x)
    np.fill_diagonal(d, np.inf)  # a point is not its own neighbour
    target = np.log(perplexity)
    beta = np.ones(n)
    low, high = np.zeros(n), np.full(n, np.inf)
    for _ in range(steps):
        p, entropy = _row_affinities(d, beta)
        too_flat = entropy > target  # too many neighbours: narrow the Gaussian (raise beta)
        low = np.where(too_flat, beta, low)
        high = np.where(too_flat, high, beta)
        beta = np.where(np.isinf(high), beta * 2.0, (low + high) / 2.0)
        if np.all(np.abs(entropy - target) < tol):
            break
    p, _ = _row_affinities(d, beta)
    joint = (p + p.T) / (2.0 * n)
    return np.maximum(joint, 1e-12)


def _gradient(p: np.ndarray, y: np.ndarray, num: np.ndarray, w: np.ndarray) -> tuple[np.ndarray, float]:
    """Exact t-SNE gradient dC/dY [n, dims]; fills `num` with the Student-t kernel and returns its sum Z too.

    With num_ij = 1 / (1 + |y_i - y_j|^2) and q_ij = num_ij / Z: dC/dy_i = 4 sum_j (p_ij - q_ij) num_ij (y_i - y_j).
    `num` and `w` are [n, n] buffers reused across iterations: allocating n×n arrays each step costs more than
    the arithmetic."""
    norms = np.einsum("ij,ij->i", y, y)
    np.matmul(y, y.T, out=num)
    num *= -2.0
    num += norms[:, None]
    num += norms[None, :]  # squared distances; rounding may leave tiny negatives, harmless after +1
    num += 1.0
    np.reciprocal(num, out=num)
    np.fill_diagonal(num, 0.0)
    z = float(num.sum())
    np.divide(num, z, out=w)
    np.subtract(p, w, out=w)
    w *= num  # (p - q) * num
    grad = 4.0 * (w.sum(axis=1)[:, None] * y - w @ y)
    return grad, z


def _kl(p: np.ndarray, num: np.ndarray, z: float) -> float:
    q = np.maximum(num / z, 1e-12)
    return float((p * np.log(p / q)).sum())


def tsne(features: np.ndarray, dims: int = 2, perplexity: float = 30.0, iterations: int = 1000, seed: int = 0,
         learning_rate: float | None = None, exaggeration: float = 12.0, exaggeration_iters: int = 250,
         standardize_first: bool = True) -> np.ndarray:
    """Embed the rows of `features` [n, f] into `dims` dimensions; returns [n, dims].

    `perplexity` is capped at (n - 1) / 3 so that small sets still get a meaningful neighbourhood; the learning
    rate defaults to max(n / exaggeration / 4, 50), which converges without tuning across set sizes."""
    x = np.asarray(features, dtype=np.float64)
    if x.ndim != 2:
        raise ValueError(f"t-SNE needs a 2-D array of features [points, features], got shape {x.shape}; "
                         "stack one feature vector per point")
    n = x.shape[0]
    if n > MAX_POINTS:
        raise ValueError(f"exact t-SNE of {n} points would need ~{8 * 5 * n * n / 1e9:.0f} GB; "
                         f"subsample to at most {MAX_POINTS} points")
    if not np.all(np.isfinite(x)):
        raise ValueError("t-SNE features contain NaN or inf; drop or impute those points first")
    if n < 3:  # nothing to arrange: spread the points along the first axis
        out = np.zeros((n, dims))
        out[:, 0] = np.arange(n, dtype=np.float64)
        return out
    if standardize_first:
        x = standardize(x)
    perplexity = float(min(perplexity, max((n - 1) / 3.0, 1.0)))
    lr = learning_rate if learning_rate is not None else max(n / exaggeration / 4.0, 50.0)
    p = input_affinities(x, perplexity)
    return _optimize(p, dims, iterations, seed, lr, exaggeration, exaggeration_iters)


def _optimize(p: np.ndarray, dims: int, iterations: int, seed: int, lr: float, exaggeration: float,
              exaggeration_iters: int) -> np.ndarray:
    """Gradient descent with momentum and gains, P exaggerated at first so that clusters form early."""
    rng = np.random.default_rng(seed)
    y = rng.normal(0.0, 1e-4, size=(p.shape[0], dims))
    velocity = np.zeros_like(y)
    gains = np.ones_like(y)
    exaggerated = p * exaggeration
    num, w = np.empty_like(p), np.empty_like(p)
    for it in range(iterations):
        early = it < exaggeration_iters
        grad, z = _gradient(exaggerated if early else p, y, num, w)
        # Gains grow where the gradient keeps its sign against the velocity (steady descent), shrink otherwise.
        same = np.sign(grad) == np.sign(velocity)
        gains = np.maximum(np.where(same, gains * 0.8, gains + 0.2), 0.01)
        velocity = (0.5 if early else 0.8) * velocity - lr * gains * grad
        y = y + velocity
        y -= y.mean(axis=0)  # the cost is translation invariant; keep the map centred
        if (it + 1) % 250 == 0:
            log.debug("t-SNE iteration %d: KL %.4f", it + 1, _kl(p, num, z))
    return y
