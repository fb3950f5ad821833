"""`count_host_reads`: every reading method is counted under the module and function that called it, reads torch
makes itself are not cx's, and the methods are restored on exit."""

from __future__ import annotations

import torch

from cx_mesh.testing import READING_METHODS, count_host_reads

_CX_CODE = """
def reads(t):
    t.item(); t.tolist(); bool(t); float(t); int(t); t.numpy(); t.cpu()
"""


def test_testing_host_reads_attributes_each_read_to_its_cx_caller() -> None:
    namespace: dict[str, object] = {"__name__": "cx_fake.hot_path"}
    exec(compile(_CX_CODE, "cx_fake/hot_path.py", "exec"), namespace)  # a stand-in for a cx module
    reads = namespace["reads"]
    assert callable(reads)
    param = torch.nn.Parameter(torch.ones(1))
    optimizer = torch.optim.AdamW([param])
    with count_host_reads() as counted:
        reads(torch.ones(1))
        param.grad = torch.ones(1)
        optimizer.step()  # AdamW reads its CPU step counter: torch's read, not cx's
    methods = ("item", "tolist", "__bool__", "__float__", "__int__", "numpy", "cpu")
    assert counted.cx() == {f"cx_fake.hot_path:reads ({m})": 1 for m in methods}
    assert any(site.startswith("torch.") for site in counted.by_site), "torch's own reads are recorded as torch's"
    assert counted.cx(exempt=("cx_fake.hot_path:reads (item)",)).keys() == {
        f"cx_fake.hot_path:reads ({m})" for m in methods if m != "item"
    }
    assert all(not hasattr(getattr(torch.Tensor, m), "__wrapped__") for m in READING_METHODS), "restored on exit"
