"""DFlash drafter training (plans/0002): ShareGPT prompts, self-distilled responses from the
target, block-diffusion training with the target frozen. CLI: ``python -m training --help``."""
