"""Verification runs the compiled model on the eager module's own weights, not on a second copy."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch
from torch import nn

from hatch_aoti.worker.module_weights import use_module_weights


def weights_file(directory: Path, storages: dict[str, torch.Tensor], views: dict[str, tuple[str, Any]]) -> dict:
    """A ``weights.bin`` holding ``storages`` one after another, and its index of ``views`` (constant:
    (storage, tensor viewing it)), as the backend writes them."""
    places, blob = {}, bytearray()
    for name, tensor in storages.items():
        places[name] = {"offset": len(blob), "nbytes": tensor.nbytes, "dtype": "float32", "file": name}
        blob += tensor.contiguous().numpy().tobytes()
    (directory / "weights.bin").write_bytes(bytes(blob))
    tensors = {
        constant: {**places[storage], "shape": list(v.shape), "stride": list(v.stride()), "storage_offset": 0}
        for constant, (storage, v) in views.items()
    }
    return {"file": "weights.bin", "tensors": tensors}


class Runner:
    def __init__(self, fqns: dict[str, str]) -> None:
        self.fqns, self.buffer = fqns, {}

    def get_constant_names_to_original_fqns(self) -> dict[str, str]:
        return self.fqns

    def update_constant_buffer(self, constants: dict[str, Any], *flags: bool) -> None:
        self.buffer = constants


def test_frozen_weights_are_matched_to_the_modules_storage(tmp_path: Path) -> None:
    torch.manual_seed(0)
    module = nn.Sequential(nn.Linear(32, 16), nn.Linear(16, 32)).eval()
    w0, w1 = module[0].weight.detach(), module[1].weight.detach()
    folded = w0 * 2  # made by freezing: no module tensor holds these bytes
    near = w1.clone().reshape(-1)
    near[-1] += 1  # the same size and first bytes as a module weight, but not its values
    weights = weights_file(
        tmp_path,
        {"w0": w0, "w1": w1, "folded": folded, "near": near, "bias": module[0].bias.detach()},
        {
            "_frozen_param0": ("w0", w0.t()),  # a linear weight freezing keeps, transposed
            "_frozen_param1": ("w1", w1),
            "_frozen_param2": ("folded", folded),
            "_frozen_param3": ("near", near.reshape(w1.shape)),
            "0.bias": ("bias", module[0].bias),
        },
    )
    mapped = {name: torch.empty_strided(p["shape"], p["stride"]) for name, p in weights["tensors"].items()}
    runner = Runner({name: name for name in mapped})
    use_module_weights(module, SimpleNamespace(runner=runner, weights=mapped), tmp_path, weights)
    used = runner.buffer
    assert used["_frozen_param0"].data_ptr() == w0.data_ptr()
    assert (used["_frozen_param0"].shape, used["_frozen_param0"].stride()) == (w0.t().shape, w0.t().stride())
    torch.testing.assert_close(used["_frozen_param0"], w0.t(), rtol=0, atol=0)
    assert used["_frozen_param1"].data_ptr() == w1.data_ptr()
    assert used["0.bias"].data_ptr() == module[0].bias.data_ptr()
    assert used["_frozen_param2"] is mapped["_frozen_param2"]  # new values: run from the file
    assert used["_frozen_param3"] is mapped["_frozen_param3"]


def test_a_weight_the_file_holds_otherwise_fails_verification(tmp_path: Path) -> None:
    module = nn.Linear(8, 4).eval()
    wrong = module.weight.detach() + 1
    weights = weights_file(tmp_path, {"w": wrong}, {"weight": ("w", wrong)})
    compiled = SimpleNamespace(runner=Runner({"weight": "weight"}), weights={"weight": torch.empty(4, 8)})
    with pytest.raises(RuntimeError, match="other values for weight than the model"):
        use_module_weights(module, compiled, tmp_path, weights)


def test_a_storage_smaller_than_the_compared_prefix_is_matched(tmp_path: Path) -> None:
    module = nn.Linear(4, 3).eval()  # a 48-byte weight and a 12-byte bias
    w = module.weight.detach()
    weights = weights_file(tmp_path, {"w": w}, {"_frozen_param0": ("w", w.t())})
    mapped = {"_frozen_param0": torch.empty_strided((4, 3), (1, 4))}
    runner = Runner({"_frozen_param0": "_frozen_param0"})
    use_module_weights(module, SimpleNamespace(runner=runner, weights=mapped), tmp_path, weights)
    assert runner.buffer["_frozen_param0"].data_ptr() == w.data_ptr()
