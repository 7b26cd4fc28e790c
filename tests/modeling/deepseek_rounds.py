"""The engine's call pattern on a target model (shared by the TP tests on CPU and GPU)."""
import torch

from modeling.llama import causal_mask, tree_mask
from modeling.tree import tree_ancestors, visibility


@torch.inference_mode()
def greedy_rounds(model) -> tuple[list[int], torch.Tensor]:
    """Prefill, 3 one-row decodes, a tree verify + commit of a 4-row path, 2 more decodes,
    as the target engine drives a model. Returns the greedy tokens and every logits row (CPU)."""
    dev = model.lm_head.weight.device

    def t(x):
        return torch.tensor(x, device=dev)

    cache = model.new_cache(64)
    prompt = [5, 9, 17, 3, 30, 11, 8, 2, 40, 7, 19, 21]
    T = len(prompt)
    h, _ = model(t(prompt), torch.arange(T, device=dev), cache, causal_mask(0, T, dev), (0, 2))
    cache.length = T
    rows = [model.logits(h[-1:])]
    out = [int(rows[-1].argmax())]
    for step in range(6):
        L = cache.length
        if step == 3:  # a tree: root = the pending token, siblings and a chain
            parents = [-1, 0, 0, 1, 3, 2, 0]
            tokens = [out[-1], out[-1] % 50, 44, 12, 13, 14, 45]
            depths, anc = tree_ancestors(parents)
            h, _ = model(t(tokens), L + torch.from_numpy(depths).to(dev), cache,
                         tree_mask(L, torch.from_numpy(visibility(depths, anc)).to(dev)), (0, 2))
            lg = model.logits(h)
            rows.append(lg)
            path = [0, 1, 3, 4]  # committed as if accepted: exercises a multi-row commit
            cache.commit(t(path))
            out += [tokens[j] for j in path[1:]] + [int(lg[path[-1]].argmax())]
            continue
        h, _ = model(t(out[-1:]), t([L]), cache, causal_mask(L, 1, dev), (0, 2))
        cache.commit(t([0]))
        rows.append(model.logits(h))
        out.append(int(rows[-1].argmax()))
    return out, torch.cat(rows).cpu()
