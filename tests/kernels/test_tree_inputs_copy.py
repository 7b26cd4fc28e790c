"""TreeInputs' host → device copy is asynchronous (pinned buffer, non_blocking): a load must not
rewrite the pinned host buffer before the device has read the previous load's copy. A prefill
chunk returns without a host sync, so without that wait the next load (another thread's verify
batch or the next chunk) overwrote the inputs of a forward still queued on the GPU: that forward
ran another request's tokens / slots / KV moves (issue 14 H200 mismatches, session 5). GPU only:
on the CPU the copy is synchronous, so the race cannot happen there."""
import numpy as np
import pytest
import torch

from modeling.graphs import TreeRows, TreeInputs
from modeling.tree import tree_ancestors

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="an asynchronous copy needs a GPU")


def chain(tokens, base, L):
    depths, anc = tree_ancestors(np.arange(-1, len(tokens) - 1))
    return TreeRows(tokens, depths, anc, base, L)


def test_load_waits_for_the_previous_copy():
    dev = torch.device("cuda")
    inputs = TreeInputs(64, dev, max_trees=4, table=9, page_rows=16)
    a, b = chain([11, 12, 13], [3, 4], 5), chain([21, 22], [7], 2)
    for _ in range(3):
        torch.cuda._sleep(200_000_000)  # the stream is busy: A's copy waits behind this
        inputs.load_trees([a], 3)
        seen = inputs.dev.clone()       # what A's forward would read (stream order)
        inputs.load_trees([b], 2)       # the host rewrites the buffer for the next forward
        torch.cuda.synchronize()
        assert seen[:3].tolist() == [11, 12, 13]           # A's tokens, not B's
        assert seen[64:67].tolist() == [5, 6, 7]           # A's positions
        assert seen[inputs.t:inputs.t + 2].tolist() == [3, 4]  # A's page table
