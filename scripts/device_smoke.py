"""Quick GPU smoke test of the training path on a tiny random target (run on the device before
the real job): batched generation, target features, a few bf16-autocast training steps, export."""
import sys
import tempfile

import torch

sys.path.insert(0, ".")
from tests.test_training import tiny_drafter_config, tiny_target  # noqa: E402
from training.batched import generate  # noqa: E402
from training.train import TrainArgs, export_bf16, train  # noqa: E402

target = tiny_target().to("cuda", torch.bfloat16)
prompts = [torch.randint(4, 48, (n,)).tolist() for n in (5, 9, 7, 12)] * 4
outs = generate(target, prompts, 20, torch.tensor([0.0, 0.8] * 8), (0,))
data = {"tokens": [torch.tensor(p + o, dtype=torch.int32) for p, o in zip(prompts, outs)],
        "prompt_lens": [len(p) for p in prompts], "temps": [0.0] * len(prompts)}
runs = train(target, data, {"a": tiny_drafter_config(target), "b": tiny_drafter_config(target, 8)},
             TrainArgs(max_steps=12, batch_seqs=4, eval_every=6, eval_seqs=4))
export_bf16(runs[0].drafter, tempfile.mkdtemp())
print("SMOKE OK", [r.evals[-1] for r in runs])
