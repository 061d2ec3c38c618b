"""clip_jax and the outside world: OpenCLIP weights both ways, pretrained starts, export to OpenCLIP's
folders, the inference API (`create_model_and_transforms`), the similarity demo."""
