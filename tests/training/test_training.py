"""DFlash training recipe on tiny CPU models (plans/0002): block mask, labels, loss weights,
the structured attention against the dense-mask reference, a few steps reduce the loss, and
the ShareGPT truncation repair."""
from __future__ import annotations

import json
import math

import pytest
import torch

from modeling.config import LlamaConfig
from modeling.dflash import DFlashConfig, DFlashDrafter, default_taps
from modeling.llama import LlamaModel
from training.batched import generate, target_features
from training.recipe import (IGNORE, block_mask, blocks_forward, loss_weights, make_blocks, sample_anchors)
from training.sharegpt import complete_records, first_user_turns
from training.train import TrainArgs, train

MASK = 3


def tiny_target(seed=0) -> LlamaModel:
    cfg = LlamaConfig(vocab_size=48, hidden_size=32, intermediate_size=64, num_hidden_layers=6,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512)
    torch.manual_seed(seed)
    m = LlamaModel(cfg)
    for p in m.parameters():
        torch.nn.init.normal_(p, std=0.3) if p.dim() > 1 else None
    return m.eval().requires_grad_(False)


def tiny_drafter_config(target: LlamaModel, block_size=4) -> DFlashConfig:
    c = target.cfg
    return DFlashConfig(hidden_size=c.hidden_size, num_hidden_layers=2, num_attention_heads=4,
                        num_key_value_heads=2, head_dim=8, intermediate_size=64, vocab_size=c.vocab_size,
                        target_layer_ids=tuple(default_taps(c.num_hidden_layers, 3)), mask_token_id=MASK,
                        block_size=block_size)


def test_block_mask_sees_context_before_anchor_and_own_block():
    anchors, S, B = torch.tensor([2, 5]), 7, 3
    m = block_mask(anchors, S, B)
    assert m.shape == (6, S + 6)
    for i, a in enumerate(anchors.tolist()):
        for j in range(B):
            row = m[i * B + j]
            assert row[:S].tolist() == [p < a for p in range(S)]  # strictly before the anchor
            own = [i * B <= k < (i + 1) * B for k in range(6)]  # own block, all slots (bidirectional)
            assert row[S:].tolist() == own


def test_labels_are_same_position_and_slot0_is_the_anchor_token():
    seq = torch.arange(10, 20)[None]  # token at position p is 10 + p
    blocks = make_blocks(seq, torch.tensor([8]), [torch.tensor([3, 6])], 4, MASK)
    assert blocks.tokens[0].tolist() == [[13, MASK, MASK, MASK], [16, MASK, MASK, MASK]]
    assert blocks.positions[0].tolist() == [[3, 4, 5, 6], [6, 7, 8, 9]]
    # slot j predicts the token at its own position; nothing for slot 0 or past the end (len 8)
    assert blocks.labels[0].tolist() == [[IGNORE, 14, 15, 16], [IGNORE, 17, IGNORE, IGNORE]]


def test_anchors_inside_response():
    a = sample_anchors(prompt_len=5, length=12, max_anchors=512, generator=torch.Generator().manual_seed(0))
    assert a.tolist() == list(range(5, 11))  # all of [prompt_len, length-2]
    assert len(sample_anchors(5, 300, 16)) == 16


def test_early_anchors_weight_the_response_start():
    """(W, share): share · max of the anchors in the first W response positions, the rest after;
    a response too short for one part gives its anchors to the other; share 0 is the uniform
    draw bit for bit."""
    g = lambda: torch.Generator().manual_seed(3)  # noqa: E731
    a = sample_anchors(10, 650, 64, g(), early=(128, 0.5))
    assert len(a) == 64 and len(set(a.tolist())) == 64 and a.min() >= 10 and a.max() <= 648
    assert int((a < 10 + 128).sum()) == 32  # 25 % of the first 128 positions, 32 of the other 511
    # a short response: every position in the window, as many anchors as the uniform draw
    assert sample_anchors(10, 60, 64, g(), early=(128, 0.5)).tolist() == list(range(10, 59))
    # a window holding fewer positions than its share: the tail takes the rest
    b = sample_anchors(10, 650, 64, g(), early=(16, 0.5))
    assert len(b) == 64 and int((b < 26).sum()) == 16
    assert torch.equal(sample_anchors(10, 650, 64, g(), early=(128, 0.0)), sample_anchors(10, 650, 64, g()))
    # over many draws the first 128 positions are anchored 2.5× as often as under the uniform draw
    gen, hits = torch.Generator().manual_seed(0), 0
    for _ in range(200):
        hits += int((sample_anchors(10, 650, 64, gen, early=(128, 0.5)) < 138).sum())
    assert hits == 200 * 32
    # never more than max_anchors: a share above 1 or a negative W is refused
    for bad in ((20, 2.0), (-3, 0.5)):
        with pytest.raises(ValueError, match="early anchors"):
            sample_anchors(0, 40, 8, g(), early=bad)


def test_loss_weights_decay():
    for B, g in ((16, 7.0), (8, 4.0)):
        w = loss_weights(B)
        assert w[0] == 0
        for k in range(1, B):
            assert math.isclose(float(w[k]), math.exp(-(k - 1) / g), rel_tol=1e-6)


def test_structured_attention_matches_dense_block_mask():
    """blocks_forward == DFlashDrafter.forward with block_mask, i.e. what inference does for
    one block at p = anchor with context rows < p."""
    target = tiny_target()
    c = tiny_drafter_config(target)
    drafter = DFlashDrafter.random(c, seed=1)
    seqs = torch.randint(4, 48, (2, 12))
    lengths = torch.tensor([12, 9])
    anchors = [torch.tensor([3, 4, 8, 10]), torch.tensor([2, 6])]
    feats = target_features(target, seqs, c.target_layer_ids)
    blocks = make_blocks(seqs, lengths, anchors, c.block_size, MASK)
    embed = target.model.embed_tokens.weight
    with torch.no_grad():
        fast = blocks_forward(drafter, embed, feats, blocks)
        for r in range(2):
            a = anchors[r]
            L = int(lengths[r])
            ctx = drafter.context_kv(feats[r, :L], torch.arange(L))
            toks = blocks.tokens[r, :len(a)].reshape(-1)
            ref = drafter(embed[toks], blocks.positions[r, :len(a)].reshape(-1), ctx,
                          block_mask(a, L, c.block_size))
            torch.testing.assert_close(fast[r, :len(a)].reshape(-1, c.hidden_size), ref, atol=1e-5, rtol=1e-4)
            # and one block alone, exactly as DraftEngine.draft runs it at p = anchor
            p = int(a[1])
            ctx_p = drafter.context_kv(feats[r, :p], torch.arange(p))
            one = drafter(embed[blocks.tokens[r, 1]], torch.arange(p, p + c.block_size), ctx_p)
            torch.testing.assert_close(fast[r, 1], one, atol=1e-5, rtol=1e-4)


def test_few_steps_reduce_loss():
    target = tiny_target()
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(4, 48, (6,), generator=g).tolist() for _ in range(24)]
    outs = generate(target, prompts, 24, torch.zeros(len(prompts)), (0,), g)
    data = {"tokens": [torch.tensor(p + o, dtype=torch.int32) for p, o in zip(prompts, outs)],
            "prompt_lens": [len(p) for p in prompts], "temps": [0.0] * len(prompts)}
    c = tiny_drafter_config(target)
    runs = train(target, data, {"tiny": c}, TrainArgs(max_steps=40, batch_seqs=4, lr=3e-3, eval_every=20,
                                                      eval_seqs=4, max_anchors=64), log=lambda *_: None)
    ev = runs[0].evals
    assert ev[-1]["loss"] < 0.8 * runs[0].curve[0][1]  # held-out loss well below the first step
    assert runs[0].curve[-1][1] < runs[0].curve[0][1]


def test_sharegpt_repair_recovers_complete_records():
    recs = [{"id": f"r{i}", "conversations": [{"from": "human", "value": f"q{i} ]}}{{\"x"},
                                              {"from": "gpt", "value": "a"}]} for i in range(3)]
    text = json.dumps(recs, indent=2)
    cut = text[: text.index('"r2"') + 10]  # cut inside the third record
    assert [r["id"] for r in complete_records(cut)] == ["r0", "r1"]
    assert [r["id"] for r in complete_records(text)] == ["r0", "r1", "r2"]
    assert first_user_turns(complete_records(cut) + complete_records(cut)) == ['q0 ]}{"x', 'q1 ]}{"x']


def test_held_out_ids_come_from_greedy_sequences_and_refuse_all_sampled_data():
    from training.train import choose_eval_ids

    data = {"tokens": [[1]] * 30, "temps": [0.0, 0.8, 1.0] * 10, "job_ids": list(range(100, 130))}
    ids = choose_eval_ids(data, 128, 0)
    assert len(ids) == 1 and (ids[0] - 100) % 3 == 0  # a tenth of the 10 greedy sequences, a greedy one
    import pytest

    with pytest.raises(ValueError, match="no greedy sequence"):
        choose_eval_ids({"tokens": [[1]] * 4, "temps": [0.7] * 4}, 128, 0)


def _toy_data():
    """Three prompts, each answered greedily and sampled; prompt lengths 2."""
    tokens, plens, temps, jobs = [], [], [], []
    for i, prompt in enumerate(([1, 2], [3, 4], [5, 6])):
        for t in (0.0, 0.8):
            tokens.append(torch.tensor(prompt + [9, 9, i], dtype=torch.int32))
            plens.append(2)
            temps.append(t)
            jobs.append(10 * i + (t > 0))
    return {"tokens": tokens, "prompt_lens": plens, "temps": temps, "job_ids": jobs}


def test_no_answer_to_a_held_out_prompt_is_trained_on(tmp_path):
    from training.heldout import load, prompt_key, save
    from training.train import heldout_prompts, training_ids

    data = _toy_data()
    # holding out prompt 0's greedy answer also keeps its sampled answer (job 1) out of training
    assert training_ids(data, [0]) == [10, 11, 20, 21]
    # an earlier lineage's held-out prompt (stored with its checkpoint) stays out too
    save(tmp_path, {prompt_key([5, 6, 9], 2)})
    assert load(tmp_path) == {prompt_key(data["tokens"][4], 2)}
    assert training_ids(data, [0], load(tmp_path)) == [10, 11]
    assert heldout_prompts(data, [0, 20]) == {prompt_key([1, 2], 2), prompt_key([5, 6], 2)}
    assert load(tmp_path / "nothing-here") == set()


def test_an_earlier_lineage_s_held_out_prompts_are_chosen_first():
    from training.heldout import prompt_key
    from training.train import choose_eval_ids

    data = _toy_data()
    data = {k: v * 4 for k, v in data.items()}  # 12 greedy sequences → a tenth: one held out
    data["job_ids"] = list(range(len(data["tokens"])))
    for seed in range(5):  # whatever the seed, the known prompt's greedy answer is the one
        ids = choose_eval_ids(data, 128, seed, {prompt_key([3, 4], 2)})
        assert len(ids) == 1 and data["tokens"][ids[0]][:2].tolist() == [3, 4] and data["temps"][ids[0]] == 0.0
