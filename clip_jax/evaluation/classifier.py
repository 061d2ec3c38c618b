"""The zero-shot classifier, by OpenCLIP's protocol.

For each class, every prompt (a template filled with the class name) is encoded and L2-normalised; the class
embedding is their mean, L2-normalised again. The classifier is the matrix of class embeddings [E, C], and an
image's logits are `100 * image_features @ classifier`.
"""

import functools
from collections.abc import Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh

from clip_jax.errors import InvalidInput
from clip_jax.evaluation.batches import pad_rows
from clip_jax.evaluation.encoder import ShardedEncoder, round_up
from clip_jax.models import l2_normalize
from clip_jax.runtime.stop_signals import never
from clip_jax.text.model_tokenizer import check_vocabulary as check_vocabulary_of
from clip_jax.text.model_tokenizer import tokenizer_for

LOGIT_SCALE = 100.0


def check_vocabulary(model) -> None:
    """Refuses a model whose tokenizer is not there or not its text tower's (`model_tokenizer.tokenizer_for`): a
    text tower too small for CLIP's BPE, a SigLIP tower without its SentencePiece files."""
    check_vocabulary_of(model.config, tokenizer_for(model.config))


def tokenize_for(model, texts: Sequence[str]) -> np.ndarray:
    """Token ids int32 [N, L] at the model's context length, by the model's own tokenizer."""
    check_vocabulary(model)
    return tokenizer_for(model.config)(list(texts))


@functools.partial(jax.jit, static_argnums=(1, 2))
def _class_embeddings(features, num_classes, num_templates):
    # features: [rows, E] normalised, rows >= num_classes * num_templates (padding at the end)
    features = features[:num_classes * num_templates].reshape(num_classes, num_templates, -1)
    return l2_normalize(jnp.mean(features, axis=1))  # [num_classes, E]


def check_prompts(prompts: Sequence[Sequence[str]]) -> None:
    """Refuses `prompts` [C][T] with no classes, or with classes of different (or no) numbers of prompts."""
    if not prompts:
        raise InvalidInput("no classes to build a zero-shot classifier for")
    num_templates = len(prompts[0])
    if num_templates == 0 or any(len(p) != num_templates for p in prompts):
        raise InvalidInput("every class needs the same, non-zero number of prompts; got "
                           f"{sorted({len(p) for p in prompts})}")


def prompt_tokens(model, prompts: Sequence[Sequence[str]]) -> np.ndarray:
    """Token ids int32 [C * T, L] of `prompts` [C][T], class by class: the classifier's input, the same for any
    params."""
    check_prompts(prompts)
    return tokenize_for(model, [text for class_prompts in prompts for text in class_prompts])


def classifier_from_tokens(encoder: ShardedEncoder, params, tokens: np.ndarray, num_templates: int, *,
                           text_batch_size: int = 1024, progress: bool = False,
                           should_stop: Callable[[], bool] = never) -> np.ndarray:
    """The classifier float32 [E, C] from `prompt_tokens` [C * T, L], with `params` placed by `encoder.place`.

    Each step encodes the prompts of as many whole classes as fit in `text_batch_size` rows (at least one class;
    rows rounded up to a multiple of the mesh size), split over the mesh. Every step has the same shape (the last
    is padded), so the text tower compiles once per dataset. `should_stop` is asked before each step (see
    `encoder`).
    """
    num_classes = len(tokens) // num_templates
    classes_per_batch = min(num_classes, max(1, text_batch_size // num_templates))
    rows = round_up(classes_per_batch * num_templates, encoder.mesh.size)
    starts = range(0, num_classes, classes_per_batch)
    if progress and jax.process_index() == 0:
        import tqdm

        starts = tqdm.tqdm(starts, desc="classifier", unit="class", unit_scale=classes_per_batch)
    embeddings = []
    for start in starts:
        batch = pad_rows(tokens[start * num_templates:(start + classes_per_batch) * num_templates], rows)
        features = encoder.text_features(params, batch, should_stop=should_stop)  # [rows, E], replicated
        embeddings.append(_class_embeddings(features, classes_per_batch, num_templates))  # [classes_per_batch, E]
    embeddings = np.concatenate([np.asarray(e) for e in embeddings])[:num_classes]  # [C, E]
    return np.ascontiguousarray(embeddings.T)


def build_zeroshot_classifier(model, params, prompts: Sequence[Sequence[str]], mesh: Mesh, *,
                              text_batch_size: int = 1024, progress: bool = False) -> np.ndarray:
    """The classifier float32 [E, C] for `prompts` [C][T] (T prompts per class, the same T for every class); see
    `classifier_from_tokens` for how the prompts are batched."""
    encoder = ShardedEncoder(model, mesh)
    return classifier_from_tokens(encoder, encoder.place(params), prompt_tokens(model, prompts), len(prompts[0]),
                                  text_batch_size=text_batch_size, progress=progress)


def zeroshot_logits(image_features, classifier):
    """`100 * image_features @ classifier`: [B, E] x [E, C] -> [B, C], float32 at full precision."""
    return LOGIT_SCALE * jnp.matmul(image_features, classifier, precision=jax.lax.Precision.HIGHEST)
