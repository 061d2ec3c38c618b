"""CLIP_benchmark's linear probe, in JAX: a linear classifier on frozen, L2-normalised image features.

The classifier (weights [E, C] and bias [C], from zeros) is trained with AdamW (decoupled weight decay on both) and a
cosine learning-rate schedule from `lr` to 0 over `epochs` passes of shuffled mini-batches (the last one of an epoch
partial), minimising the mean cross-entropy; the metrics are `lp_acc1`, `lp_acc5` (NaN below 5 classes) and
`lp_mean_per_class_recall` of its logits on the test features.

Weight decay is searched as CLIP_benchmark searches it: 97 values log-spaced over [1e-6, 1e-2]; first every 16th
(seven), then around the best so far at steps of 8, 4, 2, 1 values; each scored by top-1 accuracy on the validation
features (ties: the smaller decay). The chosen decay is then refit on train + validation. Every candidate of a round
trains at once (`jax.vmap` over the decays): one compilation, one pass over the data per round.

`fewshot_k` keeps k images per class of the train features, drawn with the seed, before a validation share is
carved off them: the probe never sees more than k images of a class (unless a separate validation split is given,
which the refit trains on too).
"""

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax

from clip_jax.errors import InvalidInput
from clip_jax.evaluation import metrics as metrics_lib

WEIGHT_DECAYS = np.logspace(-6, -2, num=97)
COARSE_STEP = 16  # the first round: decays 0, 16, ..., 96 (seven)
REFINE_SPANS = (8, 4, 2, 1)
PARALLEL_DECAYS = 7  # classifiers trained at once (vmap): the first round's seven


@dataclasses.dataclass(frozen=True)
class ProbeOptions:
    """CLIP_benchmark's defaults: `--fewshot_lr 0.1 --fewshot_epochs 10 --batch_size 64 --seed 0`."""

    lr: float = 0.1
    epochs: int = 10
    batch_size: int = 64
    seed: int = 0


@functools.partial(jax.jit, static_argnames=("num_classes", "batch_size", "epochs"))
def _fit(features, labels, weight_decays, key, lr, *, num_classes: int, batch_size: int, epochs: int):
    """Classifiers trained on features [N, E] / labels [N], one per weight decay [W]: (weights [W, E, C], bias
    [W, C]). Every classifier sees the same batches."""
    num_rows, width = features.shape
    steps = -(-num_rows // batch_size)
    schedule = optax.cosine_decay_schedule(lr, steps * epochs)
    slots = jnp.arange(steps * batch_size)
    valid = (slots < num_rows).reshape(steps, batch_size)

    def batches(epoch_key):  # row indices [steps, B]; the slots past N hold row 0, masked out by `valid`
        order = jax.random.permutation(epoch_key, num_rows)
        return jnp.pad(order, (0, steps * batch_size - num_rows)).reshape(steps, batch_size)

    def fit_one(weight_decay):
        optimizer = optax.adamw(schedule, weight_decay=weight_decay)
        params = {"weights": jnp.zeros((width, num_classes)), "bias": jnp.zeros((num_classes,))}

        def loss(params, rows, mask):
            logits = features[rows] @ params["weights"] + params["bias"]  # [B, C]
            losses = optax.softmax_cross_entropy_with_integer_labels(logits, labels[rows])
            return jnp.sum(losses * mask) / jnp.sum(mask)

        def step(carry, batch):
            params, state = carry
            grads = jax.grad(loss)(params, *batch)
            updates, state = optimizer.update(grads, state, params)
            return (optax.apply_updates(params, updates), state), None

        def epoch(carry, epoch_key):
            return jax.lax.scan(step, carry, (batches(epoch_key), valid))[0], None

        carry = (params, optimizer.init(params))
        params = jax.lax.scan(epoch, carry, jax.random.split(key, epochs))[0][0]
        return params["weights"], params["bias"]

    return jax.vmap(fit_one)(weight_decays)


def fit_classifiers(features: np.ndarray, labels: np.ndarray, num_classes: int, weight_decays,
                    options: ProbeOptions) -> tuple[np.ndarray, np.ndarray]:
    """Host weights float32 [W, E, C] and bias [W, C]: one classifier per weight decay (see the module docstring).
    The decays are padded to a multiple of `PARALLEL_DECAYS`, so that every round of a search has one shape."""
    weight_decays = np.asarray(weight_decays, np.float32)
    count = len(weight_decays)
    padded = np.resize(weight_decays, -(-count // PARALLEL_DECAYS) * PARALLEL_DECAYS)
    weights, bias = _fit(jnp.asarray(features, jnp.float32), jnp.asarray(labels, jnp.int32),
                         jnp.asarray(padded), jax.random.key(options.seed),
                         jnp.float32(options.lr), num_classes=num_classes,
                         batch_size=min(options.batch_size, len(labels)), epochs=options.epochs)
    return np.asarray(weights)[:count], np.asarray(bias)[:count]


def search_weight_decay(train: tuple[np.ndarray, np.ndarray], val: tuple[np.ndarray, np.ndarray], num_classes: int,
                        options: ProbeOptions) -> tuple[float, dict[float, float]]:
    """The weight decay of best validation top-1 (CLIP_benchmark's search) and the top-1 of every decay tried."""
    scores: dict[int, float] = {}

    def score(indices) -> None:
        new = sorted(set(indices) - set(scores))
        if not new:
            return
        weights, bias = fit_classifiers(*train, num_classes, WEIGHT_DECAYS[new], options)
        for i, index in enumerate(new):
            logits = val[0] @ weights[i] + bias[i]
            scores[index] = metrics_lib.topk_accuracy(logits, val[1], 1)

    def best(indices) -> int:
        score(indices)
        return max(sorted(indices), key=lambda i: (scores[i], -i))

    peak = best(range(0, len(WEIGHT_DECAYS), COARSE_STEP))
    for span in REFINE_SPANS:
        peak = best([max(peak - span, 0), peak, min(peak + span, len(WEIGHT_DECAYS) - 1)])
    return float(WEIGHT_DECAYS[peak]), {float(WEIGHT_DECAYS[i]): s for i, s in sorted(scores.items())}


def fewshot_indices(labels: np.ndarray, k: int, seed: int, class_names) -> np.ndarray:
    """Indices of k rows of each class (a seeded draw, in row order); a class with fewer than k is refused."""
    labels = np.asarray(labels)
    counts = np.bincount(labels, minlength=len(class_names))
    short = np.flatnonzero(counts < k)
    if short.size:
        c = int(short[0])
        raise InvalidInput(f"--fewshot_k {k} is more than class {c} ({class_names[c]!r}) has in the train split "
                           f"({int(counts[c])} images): give --fewshot_k {int(counts.min())} or less")
    order = np.random.default_rng(seed).permutation(len(labels))
    keep = np.concatenate([order[labels[order] == c][:k] for c in range(len(class_names))])
    return np.sort(keep)


def validation_split(labels: np.ndarray, proportion: float, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """(train indices, validation indices): `proportion` of each class's rows (rounded, at least one of a class of
    two or more) drawn with the seed for validation."""
    rng = np.random.default_rng(seed)
    train, val = [], []
    for c in np.unique(labels):
        rows = rng.permutation(np.flatnonzero(labels == c))
        take = min(max(int(round(proportion * len(rows))), 1), len(rows) - 1) if len(rows) > 1 else 0
        val.append(rows[:take])
        train.append(rows[take:])
    return np.sort(np.concatenate(train)), np.sort(np.concatenate(val))


def probe_metrics(logits: np.ndarray, labels: np.ndarray) -> dict[str, float]:
    """`lp_acc1`, `lp_acc5`, `lp_mean_per_class_recall` of logits [N, C] and labels [N]."""
    return {"lp_acc1": metrics_lib.topk_accuracy(logits, labels, 1),
            "lp_acc5": metrics_lib.topk_accuracy(logits, labels, 5),
            "lp_mean_per_class_recall": metrics_lib.mean_per_class_recall(logits, labels)}


@dataclasses.dataclass(frozen=True)
class ProbeResult:
    metrics: dict[str, float]
    weight_decay: float
    val_scores: dict[float, float]  # decay -> validation top-1 (empty without a search)
    num_train: int


def linear_probe(train: tuple[np.ndarray, np.ndarray], test: tuple[np.ndarray, np.ndarray], class_names, *,
                 val: tuple[np.ndarray, np.ndarray] | None = None, val_proportion: float = 0.0, fewshot_k: int = -1,
                 options: ProbeOptions = ProbeOptions()) -> ProbeResult:
    """CLIP_benchmark's linear probe of (features, labels) pairs. `fewshot_k` > 0 first keeps k train images per
    class. The weight decay is searched on `val`, or else on a stratified `val_proportion` of (those) train images,
    and the classifier refit on train + validation; with neither, weight decay 0."""
    num_classes = len(class_names)
    for name, (features, labels) in (("train", train), ("test", test), ("validation", val or train)):
        bad = labels[(labels < 0) | (labels >= num_classes)]
        if bad.size:
            raise InvalidInput(f"the {name} split has label {int(bad[0])} but {num_classes} class names (labels "
                               f"0..{num_classes - 1}): give one class name per label")
    if fewshot_k > 0:
        keep = fewshot_indices(train[1], fewshot_k, options.seed, class_names)
        train = (train[0][keep], train[1][keep])
    if val is None and val_proportion > 0:
        keep, held = validation_split(train[1], val_proportion, options.seed)
        train, val = (train[0][keep], train[1][keep]), (train[0][held], train[1][held])
    weight_decay, scores = 0.0, {}
    if val is not None and len(val[1]):
        weight_decay, scores = search_weight_decay(train, val, num_classes, options)
        train = (np.concatenate([train[0], val[0]]), np.concatenate([train[1], val[1]]))
    weights, bias = fit_classifiers(*train, num_classes, [weight_decay], options)
    logits = test[0] @ weights[0] + bias[0]
    return ProbeResult(probe_metrics(logits, test[1]), weight_decay, scores, len(train[1]))
