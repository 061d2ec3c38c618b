"""The per-channel pixel mean and standard deviation of OpenAI's CLIP, OpenCLIP's defaults.

A module of its own so that the run config (`clip_jax.run_config`) can name them without importing the data
package, and the data transforms, the evaluation and the tools share one copy.
"""

OPENAI_MEAN = (0.48145466, 0.4578275, 0.40821073)
OPENAI_STD = (0.26862954, 0.26130258, 0.27577711)
