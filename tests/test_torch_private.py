"""Each private torch API hatch-aoti uses (``hatch_aoti/_torch_private.py``), checked on this torch and
on the next one the tests install: a release that moves one fails here, not in a user's build."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

torch = pytest.importorskip("torch")

from conftest import REPO

from hatch_aoti import _torch_private
from hatch_aoti.loader.packing import OPS

#: Run in a torch environment with hatch-aoti's modules on the path: one JSON line of what each touch did.
PROBE = """
import json, shutil, sys, tempfile
from pathlib import Path
import torch
from torch._inductor import codecache, cpp_builder
from torch._inductor.runtime.cache_dir_utils import cache_dir
from hatch_aoti import _torch_private as private

found = {"torch": torch.__version__.split("+")[0]}
private.keep_gelu_apart()  # before Inductor registers its oneDNN fusions, as every compile calls it
from torch._inductor.fx_passes.mkldnn_fusion import _mkldnn_fusion_init
_mkldnn_fusion_init()
found["keep_gelu_apart"] = sorted(private.GELU_KEPT_APART) == [
    "mkldnn._linear_pointwise.default + gelu (none)", "mkldnn._linear_pointwise.default + gelu (tanh)"
]
with tempfile.TemporaryDirectory() as tmp:
    with private.inductor_cache(Path(tmp) / "inductor"):
        found["inductor_cache"] = cache_dir() == str(Path(tmp) / "inductor")
    compiler = private.cpp_compiler()
    found["cpp_compiler"] = bool(shutil.which(compiler) or Path(compiler).is_file())
    private.preload_export()
    found["preload_export"] = "torch.export._trace" in sys.modules
    codecache._HEADER_DIR = str(Path(tmp) / "headers")
    stale = Path(tmp) / "headers" / "hatch-aoti" / "gone"
    stale.mkdir(parents=True)
    (stale / "torch-path").write_text("/no/such/torch")
    private.use_header_store()
    home = Path(codecache._HEADER_DIR)
    found["use_header_store"] = (
        home.parent == Path(tmp) / "headers" / "hatch-aoti" and (home / "torch-path").is_file()
        and codecache._HEADER_LOCK_DIR == str(home / "locks") and not stale.exists()
    )
    flags_of, command_of = cpp_builder._get_optimization_cflags, cpp_builder.CppBuilder.get_command_line
    with private.portable_paths():
        wrapped = cpp_builder._get_optimization_cflags is not flags_of
        wrapped = wrapped and cpp_builder.CppBuilder.get_command_line is not command_of
        cflags, _ = cpp_builder._get_optimization_cflags(private.cpp_compiler())
    restored = cpp_builder._get_optimization_cflags is flags_of
    restored = restored and cpp_builder.CppBuilder.get_command_line is command_of
    mapped = any(f.startswith("ffile-prefix-map=") and f.endswith("=torch") for f in cflags)
    found["portable_paths"] = wrapped and restored and mapped
from torch.fx.experimental import proxy_tensor
torch.export.export(torch.nn.Linear(2, 2), (torch.randn(1, 2),))
kept = proxy_tensor._FAKE_TENSOR_ID_TO_PROXY_MAP_FOR_EXPORT
filled = bool(kept)
private.release_trace()
found["release_trace"] = filled and not proxy_tensor._FAKE_TENSOR_ID_TO_PROXY_MAP_FOR_EXPORT
from torch._inductor import config
from torch._inductor.constant_folding import ConstantFolder, constant_fold
mkldnn, run_node, no_pass = torch.ops.mkldnn, ConstantFolder.run_node, config.post_grad_custom_post_pass

graph = torch.fx.Graph()  # what Inductor's packing leaves for freezing to fold
x, w = graph.placeholder("x"), graph.get_attr("w")
args = ([1, 1], [1, 1], [1, 1], 1)
packed_w = graph.call_function(mkldnn._reorder_convolution_weight, (w, *args, [1, 3, 8, 8]))
graph.output(graph.call_function(mkldnn._convolution_pointwise, (x, packed_w, None, *args, "none", [], "")))
root = torch.nn.Module()
weight = torch.randn(8, 3, 3, 3)
root.register_buffer("w", weight)
gm = torch.fx.GraphModule(root, graph)
from hatch_aoti.loader.packing import OPS
with private.packed_weights(OPS) as packed:
    constant_fold(gm)
    (name,) = [n.target for n in gm.graph.find_nodes(op="get_attr") if getattr(gm, n.target).is_mkldnn]
    config.post_grad_custom_post_pass(gm.graph)
replay = packed.replays.get(name)
found["packed_weights"] = (
    torch.equal(getattr(gm, name), weight) and ConstantFolder.run_node is run_node
    and config.post_grad_custom_post_pass is no_pass
    and replay == {"op": "mkldnn::_reorder_convolution_weight", "args": [[1, 1], [1, 1], [1, 1], 1, [1, 3, 8, 8]]}
)
from types import SimpleNamespace
from torch._inductor.graph import GraphLowering
allocate = GraphLowering.allocate_non_dup_const_name
lowering = SimpleNamespace(constants={}, constant_reprs={}, allocated_constant_name={}, qualify_name=lambda n: n)
with private.distinct_constant_names():  # two constants a lowering names alike, as oneDNN's int8 ones are
    made = [GraphLowering.allocate_non_dup_const_name(lowering, "x_scale", torch.tensor(v)) for v in (1.0, 2.0)]
found["distinct_constant_names"] = (
    GraphLowering.allocate_non_dup_const_name is allocate and made == ["x_scale", "x_scale_0"]
    and lowering.allocated_constant_name == {"x_scale": "x_scale", "x_scale_0": "x_scale_0"}
)
print(json.dumps(found))
"""


def probe(python: str) -> dict[str, object]:
    env = {"PYTHONPATH": str(REPO), "PATH": "/usr/bin:/bin"}
    proc = subprocess.run([python, "-c", PROBE], capture_output=True, text=True, env=env, check=False)
    assert proc.returncode == 0, proc.stderr[-3000:]
    found: dict[str, object] = json.loads(proc.stdout.strip().splitlines()[-1])
    return found


def expected(version: str) -> dict[str, object]:
    touches = (
        "inductor_cache",
        "cpp_compiler",
        "preload_export",
        "use_header_store",
        "portable_paths",
        "release_trace",
        "packed_weights",
        "keep_gelu_apart",
        "distinct_constant_names",
    )
    return {"torch": version, **dict.fromkeys(touches, True)}


def test_every_private_touch_works_on_this_torch() -> None:
    version = torch.__version__.split("+")[0]
    assert version in _torch_private.CHECKED_ON, f"check _torch_private.py on torch {version}, then add it"
    assert probe(sys.executable) == expected(version)


@pytest.mark.integration
def test_every_private_touch_works_on_the_next_torch(torch_next_envs: Path) -> None:
    from conftest import TORCH_NEXT

    assert TORCH_NEXT in _torch_private.CHECKED_ON
    assert probe(str(torch_next_envs / f"torch-{TORCH_NEXT}" / "bin" / "python")) == expected(TORCH_NEXT)


def _folded(transposed: bool = False, shared: bool = False) -> tuple[torch.fx.GraphModule, Any]:
    """A graph as Inductor's packing leaves it, frozen under :func:`packed_weights`."""
    from torch._inductor.constant_folding import constant_fold

    graph, mkldnn = torch.fx.Graph(), torch.ops.mkldnn
    x, w = graph.placeholder("x"), graph.get_attr("w")
    args = ([1, 1], [1, 1], [1, 1], 1)
    if transposed:  # padding, output padding, stride, dilation, groups, input size
        swapped = (w, [0, 0], [0, 0], [1, 1], [1, 1], 1, [1, 3, 8, 8])
        packed_w = graph.call_function(mkldnn._reorder_convolution_transpose_weight, swapped)
        conv = (x, packed_w, None, [0, 0], [0, 0], [1, 1], [1, 1], 1, "none", [], "")
        out = graph.call_function(mkldnn._convolution_transpose_pointwise, conv)
    else:
        packed_w = graph.call_function(mkldnn._reorder_convolution_weight, (w, *args, [1, 3, 8, 8]))
        out = graph.call_function(mkldnn._convolution_pointwise, (x, packed_w, None, *args, "none", [], ""))
    graph.output((out, w) if shared else out)
    root = torch.nn.Module()
    root.register_buffer("w", torch.randn(3, 8, 3, 3) if transposed else torch.randn(8, 3, 3, 3))
    gm = torch.fx.GraphModule(root, graph)
    with _torch_private.packed_weights(OPS) as packed:
        constant_fold(gm)
        torch._inductor.config.post_grad_custom_post_pass(gm.graph)
    return gm, packed


def test_a_weight_packed_with_its_channels_swapped_is_refused() -> None:
    with pytest.raises(RuntimeError, match="cannot ship portably; set `cpp.weight_prepack = false`"):
        _folded(transposed=True)


def test_a_dense_weight_that_is_also_a_constant_of_its_own_is_not_packed_again() -> None:
    gm, packed = _folded(shared=True)
    assert not any(getattr(gm, n.target).is_mkldnn for n in gm.graph.find_nodes(op="get_attr"))
    assert packed.replays == {}, "the library holds that tensor once, for its plain use too"
    _, packed = _folded()
    assert list(packed.replays.values()) == [
        {"op": "mkldnn::_reorder_convolution_weight", "args": [[1, 1], [1, 1], [1, 1], 1, [1, 3, 8, 8]]}
    ]


def test_a_linear_weight_packed_from_its_transpose_ships_contiguous() -> None:
    """transformers' Conv1D (GPT-2) keeps its weight as (in, out): the library would copy a strided
    constant on every call."""
    from torch._inductor.constant_folding import constant_fold

    graph, mkldnn = torch.fx.Graph(), torch.ops.mkldnn
    x, w = graph.placeholder("x"), graph.get_attr("w")
    transposed = graph.call_function(torch.ops.aten.permute.default, (w, [1, 0]))
    packed_w = graph.call_function(mkldnn._reorder_linear_weight, (transposed, 4))
    graph.output(graph.call_function(mkldnn._linear_pointwise, (x, packed_w, None, "none", [], "")))
    root = torch.nn.Module()
    root.register_buffer("w", torch.randn(16, 8))
    gm = torch.fx.GraphModule(root, graph)
    with _torch_private.packed_weights({}):
        constant_fold(gm)
        torch._inductor.config.post_grad_custom_post_pass(gm.graph)
    (node,) = gm.graph.find_nodes(op="get_attr")
    shipped = getattr(gm, node.target)
    assert not shipped.is_mkldnn and shipped.is_contiguous()
    torch.testing.assert_close(shipped, root.w.t(), rtol=0, atol=0)


def _linear_folded(tied: bool) -> Any:
    """A linear layer's packing as freezing leaves it (its weight seen through two transposes), with
    the same weight used plainly too where ``tied`` (an embedding tied to the output layer)."""
    from torch._inductor.constant_folding import constant_fold

    graph, mkldnn, aten = torch.fx.Graph(), torch.ops.mkldnn, torch.ops.aten
    x, ids, w = graph.placeholder("x"), graph.placeholder("ids"), graph.get_attr("w")
    twice = graph.call_function(aten.permute.default, (graph.call_function(aten.permute.default, (w, [1, 0])), [1, 0]))
    packed_w = graph.call_function(mkldnn._reorder_linear_weight, (twice, 4))
    out = graph.call_function(mkldnn._linear_pointwise, (x, packed_w, None, "none", [], ""))
    graph.output((out, graph.call_function(aten.embedding.default, (w, ids))) if tied else out)
    root = torch.nn.Module()
    root.register_buffer("w", torch.randn(16, 8))
    gm = torch.fx.GraphModule(root, graph)
    with _torch_private.packed_weights(OPS) as packed:
        constant_fold(gm)
        torch._inductor.config.post_grad_custom_post_pass(gm.graph)
    return packed


def test_a_tied_linear_weight_is_not_packed_at_load() -> None:
    """Inductor stores two constants alike (one storage, offset, shape and stride) once: packing that
    one at load would hand the embedding a packed tensor too."""
    assert list(_linear_folded(tied=False).replays.values()) == [{"op": "mkldnn::_reorder_linear_weight", "args": [4]}]
    assert _linear_folded(tied=True).replays == {}


def test_packed_weights_that_the_pass_never_saw_fail_the_compile() -> None:
    packed = _torch_private.PackedWeights({})
    packed.made[0] = _torch_private.Packing(None, None, None, None)
    with pytest.raises(RuntimeError, match="never ran the pass"):
        packed.check()


@pytest.mark.parametrize("backend", ["aoti", "precompile"])
def test_each_inductor_backend_prepares_its_process_before_it_compiles(
    backend: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The header store and the GELU rule hold for a process only if its first compile set them up,
    whichever backend that compile is."""
    from hatch_aoti import backends

    class Prepared(Exception):
        pass

    def prepared() -> None:
        raise Prepared

    monkeypatch.setattr(_torch_private, "before_compile", prepared)
    request = backends.Request("m", None, {}, tmp_path / "out", tmp_path / "work")  # type: ignore[arg-type]
    with pytest.raises(Prepared):
        backends.get(backend).compile(request)


@pytest.mark.parametrize("tied", [False, True])
def test_an_int8_weight_ships_transposed_and_is_always_packed_at_load(tied: bool) -> None:
    """oneDNN's int8 linear kernel takes only a packed weight, packed from (out, in) into the transposed
    shape: the library holds it dense in that shape, and the loader packs it whatever else uses it."""
    from torch._inductor.constant_folding import constant_fold

    graph, onednn = torch.fx.Graph(), torch.ops.onednn
    x, w, scales, zeros = (graph.placeholder("x"), graph.get_attr("w"), graph.get_attr("s"), graph.get_attr("z"))
    packed_w = graph.call_function(onednn.qlinear_prepack.default, (w, None))
    call = (x, 0.1, 0, packed_w, scales, zeros, None, 1.0, 0, torch.float32, "none", [], "")
    out = graph.call_function(onednn.qlinear_pointwise.default, call)
    graph.output((out, w) if tied else out)
    root = torch.nn.Module()
    root.register_buffer("w", torch.randint(-127, 127, (16, 8), dtype=torch.int8))
    root.register_buffer("s", torch.full((16,), 0.01))
    root.register_buffer("z", torch.zeros(16, dtype=torch.int64))
    gm = torch.fx.GraphModule(root, graph)
    with _torch_private.packed_weights(OPS) as packed:
        constant_fold(gm)
        torch._inductor.config.post_grad_custom_post_pass(gm.graph)
    (name,) = packed.replays
    assert packed.replays[name] == {"op": "onednn::qlinear_prepack", "args": [None]}
    shipped = getattr(gm, name)
    assert not shipped.is_mkldnn and shipped.is_contiguous() and shipped.shape == (8, 16)
    assert torch.equal(shipped, root.w.t()) and shipped.untyped_storage().data_ptr() != root.w.data_ptr()


@pytest.mark.parametrize("channels", [4, 128])
def test_an_int8_convolution_weight_used_plainly_too_ships_a_copy_packed_at_load(channels: int) -> None:
    """The packing's tensor argument (the weight's scales) is recorded by value where Inductor writes it into
    its code (a few channels), else as the constant it is."""
    from torch._inductor.constant_folding import constant_fold

    graph, onednn = torch.fx.Graph(), torch.ops.onednn
    x, w, scales, zeros = (graph.placeholder("x"), graph.get_attr("w"), graph.get_attr("s"), graph.get_attr("z"))
    conv = ([1, 1], [1, 1], [1, 1], 1)
    packed_w = graph.call_function(onednn.qconv_prepack.default, (w, scales, 0.1, 0, *conv, None))
    call = (x, 0.1, 0, packed_w, scales, zeros, None, *conv, 1.0, 0, torch.float32, "none", [], "")
    graph.output((graph.call_function(onednn.qconv_pointwise.default, call), w))
    root = torch.nn.Module()
    root.register_buffer("w", torch.randint(-127, 127, (channels, 3, 3, 3), dtype=torch.int8))
    root.register_buffer("s", torch.full((channels,), 0.5))
    root.register_buffer("z", torch.zeros(channels, dtype=torch.int64))
    gm = torch.fx.GraphModule(root, graph)
    with _torch_private.packed_weights(OPS) as packed:
        constant_fold(gm)
        torch._inductor.config.post_grad_custom_post_pass(gm.graph)
    (name,) = packed.replays
    scale = {"values": [0.5] * channels, "dtype": "float32"} if channels <= 64 else {"constant": "s"}
    assert packed.replays[name] == {"op": "onednn::qconv_prepack", "args": [scale, 0.1, 0, *conv, None]}
    shipped = getattr(gm, name)
    assert torch.equal(shipped, root.w) and shipped.untyped_storage().data_ptr() != root.w.data_ptr()
