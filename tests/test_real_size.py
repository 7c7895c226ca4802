"""Models at the size people ship, built with the defaults: BERT-base and ResNet-50 (transformers'
default configs).

BERT-base has about 200 weight tensors and 420 MiB of them, so `weights = "auto"` maps them and
the weights index is larger than the manifest's small-file limit, a path no toy model takes.
ResNet-50's 50 float32 layers round its output by more than the default tolerances allow near
zero, so it passes only as close to a float64 run as eager is. Built once per session (about a
minute and a half here), installed into a venv without hatch-aoti.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest
from conftest import Runtime, build_no_isolation, write_project

pytestmark = [pytest.mark.integration, pytest.mark.heavy]
pytest.importorskip("transformers")

MODELS = """
    import torch
    from torch import nn


    class Bert(nn.Module):
        def __init__(self):
            super().__init__()
            from transformers import BertConfig, BertModel

            self.bert = BertModel(BertConfig(), add_pooling_layer=False)

        def forward(self, input_ids):
            return self.bert(input_ids=input_ids).last_hidden_state


    def bert():
        torch.manual_seed(0)
        return Bert().eval()


    def resnet():
        from transformers import ResNetConfig, ResNetModel

        torch.manual_seed(0)
        return ResNetModel(ResNetConfig()).eval()


    class Llama(nn.Module):
        def __init__(self):
            super().__init__()
            from transformers import LlamaConfig, LlamaForCausalLM

            config = LlamaConfig(
                hidden_size=256, intermediate_size=688, num_hidden_layers=2, num_attention_heads=8,
                num_key_value_heads=4, vocab_size=1000, use_cache=False,
            )
            self.llama = LlamaForCausalLM(config)

        def forward(self, input_ids):
            return self.llama(input_ids=input_ids).logits


    def llama():
        torch.manual_seed(0)
        return Llama().to(torch.bfloat16).eval()
"""
HOOK = """
    [tool.hatch.build.targets.wheel.hooks.aoti.models.bert]
    factory = "bertpkg.models:bert"
    inputs = [{ shape = [1, 128], dtype = "int64", high = 30522 }]

    [tool.hatch.build.targets.wheel.hooks.aoti.models.resnet]
    factory = "bertpkg.models:resnet"
    inputs = [{ shape = [1, 3, 224, 224] }]

    [tool.hatch.build.targets.wheel.hooks.aoti.models.llama]
    factory = "bertpkg.models:llama"
    inputs = [{ shape = [1, 32], dtype = "int64", high = 1000 }]
"""


@pytest.fixture(scope="session")
def bert_wheel(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, str]:
    project = write_project(tmp_path_factory.mktemp("bert") / "proj", "bertpkg", HOOK, {"models.py": MODELS})
    proc = build_no_isolation(project, project / "dist")
    (wheel,) = (project / "dist").glob("*.whl")
    return wheel, proc.stdout + proc.stderr


@pytest.fixture(scope="session")
def bert_site(bert_wheel: tuple[Path, str], tmp_path_factory: pytest.TempPathFactory) -> Path:
    site = tmp_path_factory.mktemp("bert-site")
    with zipfile.ZipFile(bert_wheel[0]) as zf:
        zf.extractall(site)
    return site


def test_bert_base_builds_with_the_defaults_and_maps_its_weights(bert_wheel: tuple[Path, str], bert_site: Path) -> None:
    wheel, log = bert_wheel
    assert "bert: compiled in" in log and "verified against eager" in log, log
    manifest = json.loads((bert_site / "bertpkg" / "_aoti" / "manifest.json").read_text())
    entry = manifest["models"]["bert"]
    weights = entry["weights"]
    assert len(weights["tensors"]) >= 150, "hundreds of weight tensors"
    assert (bert_site / "bertpkg" / "_aoti" / "bert" / "weights.bin").stat().st_size > 32 * 2**20
    assert not [m for m in entry["inline"] if m.endswith("weights_config.json")], "the index is the record"
    assert entry["inductor_configs"]["freezing"] is True and entry["inductor_configs"]["cpp.weight_prepack"] is True
    packing = [how["op"] for how in entry["packing"].values()]
    assert packing == ["mkldnn::_reorder_linear_weight"] * 72, "recorded; packed at load under HATCH_AOTI_PACK=all"


def test_inspect_asks_the_loader_which_weights_it_packs_at_load(bert_wheel: tuple[Path, str]) -> None:
    counts = {}
    for choice in ("", "all", "none"):
        proc = subprocess.run(
            [str(Path(sys.executable).with_name("hatch-aoti")), "inspect", str(bert_wheel[0]), "--json"],
            capture_output=True,
            text=True,
            env={**os.environ, "HATCH_AOTI_PACK": choice},
            check=False,
        )
        assert proc.returncode == 0, proc.stderr
        counts[choice] = {name: m["packed_at_load"] for name, m in json.loads(proc.stdout)["models"].items()}
    assert counts == {
        "": {"bert": 0, "resnet": 53, "llama": 0},
        "all": {"bert": 72, "resnet": 53, "llama": 0},  # llama: too little work per op to be prepacked
        "none": {"bert": 0, "resnet": 0, "llama": 0},
    }


def test_bert_base_installed_matches_eager_and_round_trips_through_torch(
    bert_site: Path, runtime: Runtime, tmp_path: Path
) -> None:
    import torch

    sys.path.insert(0, str(bert_site))
    try:
        from bertpkg.models import bert
    finally:
        sys.path.remove(str(bert_site))
    ids = torch.randint(0, 30522, (1, 128), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        expected = bert()(ids)
    torch.save(ids, tmp_path / "ids.pt")
    result = runtime.json(
        f"""
        import json, sys; sys.path.insert(0, {str(bert_site)!r})
        import torch
        from torch.export.pt2_archive._package import load_pt2
        from bertpkg import compiled
        ids = torch.load({str(tmp_path / "ids.pt")!r})
        ours = compiled.load("bert")(ids)
        torch.save(ours, {str(tmp_path / "ours.pt")!r})
        path = compiled.save_pt2("bert", {str(tmp_path / "bert.pt2")!r})
        (public,) = load_pt2(path, load_weights_from_disk=True).aoti_runners.values()
        print(json.dumps({{"type": type(ours).__name__, "save_pt2": (public(ids) - ours).abs().max().item(),
                           "mapped": any(l.rstrip().endswith("weights.bin") for l in open("/proc/self/maps"))}}))
        """
    )
    assert result == {"type": "Tensor", "save_pt2": 0.0, "mapped": True}
    torch.testing.assert_close(torch.load(tmp_path / "ours.pt"), expected, rtol=1e-4, atol=1e-4)
    packed = runtime.json(  # every linear layer's weight packed for this CPU as it loads, by choice
        f"""
        import json, os, sys, warnings; os.environ["HATCH_AOTI_PACK"] = "all"; sys.path.insert(0, {str(bert_site)!r})
        warnings.simplefilter("error")  # a packing that fails warns
        import torch
        from bertpkg import compiled
        model = compiled.load("bert")
        torch.save(model(torch.load({str(tmp_path / "ids.pt")!r})), {str(tmp_path / "all.pt")!r})
        from bertpkg.compiled import packing
        print(json.dumps(sum(model.weights[c].is_mkldnn for c in packing.chosen(compiled.info("bert")))))
        """
    )
    assert packed == 72, "each one packed"
    torch.testing.assert_close(torch.load(tmp_path / "all.pt"), expected, rtol=1e-4, atol=1e-4)


def test_bert_base_runs_its_gelus_apart_from_the_linear_layers(bert_site: Path, runtime: Runtime) -> None:
    """A GELU folded into oneDNN's linear layer as a post-op slows that product on AVX2 CPUs; the
    build keeps each one Inductor's own kernel (``keep_gelu_apart``)."""
    lines = runtime.run(
        f"""
        import os, sys; os.environ["ONEDNN_VERBOSE"] = "1"; sys.path.insert(0, {str(bert_site)!r})
        import torch
        from bertpkg import compiled
        compiled.load("bert")(torch.zeros(1, 128, dtype=torch.int64))
        """
    ).stdout.splitlines()
    products = [line for line in lines if ",exec,cpu,inner_product," in line]
    assert len(products) == 72, "every linear layer through oneDNN"
    assert not [line for line in products if "eltwise_gelu" in line], products[:3]


def test_resnet_50_builds_with_the_defaults_and_matches_eager(
    bert_wheel: tuple[Path, str], bert_site: Path, runtime: Runtime, tmp_path: Path
) -> None:
    """Its output is a transformers ``ModelOutput``: the loader rebuilds it where transformers can be
    imported, and says what is missing where it cannot."""
    import torch
    import transformers

    log = bert_wheel[1]
    assert "resnet: compiled in" in log, log
    assert "resnet: its inputs or outputs are containers defined in transformers.modeling_outputs" in log
    entry = json.loads((bert_site / "bertpkg" / "_aoti" / "manifest.json").read_text())["models"]["resnet"]
    assert "weights" in entry and len(entry["packing"]) == 53, "every convolution, mapped, packed again at load"
    sys.path.insert(0, str(bert_site))
    try:
        from bertpkg.models import resnet
    finally:
        sys.path.remove(str(bert_site))
    pixels = torch.randn(1, 3, 224, 224, generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        expected = resnet()(pixels)
    torch.save(pixels, tmp_path / "pixels.pt")
    script = f"""
        import json, sys; sys.path.insert(0, {str(bert_site)!r})
        if WITH_TRANSFORMERS:
            sys.path.append({str(Path(transformers.__file__).parents[1])!r})  # after the venv's own torch
        import torch
        from bertpkg import compiled
        try:
            ours = compiled.load("resnet")(torch.load({str(tmp_path / "pixels.pt")!r}))
        except RuntimeError as exc:
            print(json.dumps({{"error": str(exc)}}))
        else:
            torch.save(dict(ours), {str(tmp_path / "ours.pt")!r})
            print(json.dumps({{"type": type(ours).__name__, "keys": list(ours)}}))
        """
    found = runtime.json(script.replace("WITH_TRANSFORMERS", "True"))
    assert found == {"type": type(expected).__name__, "keys": list(expected)}
    ours = torch.load(tmp_path / "ours.pt")
    for key, value in expected.items():  # errors of the output's overall size, not of each element's
        torch.testing.assert_close(ours[key], value, rtol=0, atol=1e-5 * value.abs().max().item())
    alone = runtime.json(script.replace("WITH_TRANSFORMERS", "False"))
    assert isinstance(alone, dict) and alone["error"].startswith(
        "compiled model 'resnet' takes or returns containers defined in 'transformers.modeling_outputs', "
        "which cannot be imported here (No module named 'transformers'); install the package that provides it"
    )


THREADS = """
import json, os, sys, threading, time
sys.path.insert(0, {site!r})
import torch
torch.set_num_threads(1)
from bertpkg import compiled
model = compiled.load("bert")
ids = torch.randint(0, 30522, (1, 128))
model(ids)
tasks = {{1: len(os.listdir("/proc/self/task"))}}
torch.set_num_threads(2)
model(ids)
tasks[2] = len(os.listdir("/proc/self/task"))
torch.set_num_threads(1)
native, stop = [], time.monotonic() + 6
def caller():
    native.append(threading.get_native_id())
    while time.monotonic() < stop:
        model(ids)
def state(tid):  # R: running or waiting for a CPU; S: asleep (waiting for the model, say)
    with open(f"/proc/self/task/{{tid}}/stat") as f:
        return f.read().rsplit(")", 1)[1].split()[0]
callers = [threading.Thread(target=caller) for _ in range(2)]
for t in callers:
    t.start()
time.sleep(1)
both = [all(state(t) == "R" for t in native) for _ in range(200) if not time.sleep(0.01)]
for t in callers:
    t.join()
print(json.dumps({{"tasks": tasks, "both_running": sum(both) / len(both)}}))
"""


@pytest.mark.parametrize("instances", ["", "1"])
def test_calls_use_the_callers_threads_and_run_at_once(
    bert_site: Path, runtime: Runtime, monkeypatch: pytest.MonkeyPatch, instances: str
) -> None:
    """At ``torch.set_num_threads(1)`` a call starts no thread and at 2 it starts one (the kernels follow
    the caller, as eager does); two callers run at the same time, each on its own instance, unless
    ``HATCH_AOTI_INSTANCES=1`` leaves one instance, which they take in turn. Whether a caller runs
    is read from its state (running or runnable, not asleep), whatever the load on the machine."""
    monkeypatch.setenv("HATCH_AOTI_INSTANCES", instances)
    result = runtime.json(THREADS.format(site=str(bert_site)))
    assert result["tasks"]["2"] == result["tasks"]["1"] + 1, result
    if instances == "1":
        assert result["both_running"] < 0.2, result
    else:
        assert result["both_running"] > 0.8, result


def test_a_bad_instance_count_is_a_clear_error(
    bert_site: Path, runtime: Runtime, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("HATCH_AOTI_INSTANCES", "many")
    proc = runtime.run(
        f"import sys; sys.path.insert(0, {str(bert_site)!r}); from bertpkg import compiled; compiled.load('bert')",
        check=False,
    )
    assert proc.returncode != 0
    assert (
        "ValueError: HATCH_AOTI_INSTANCES='many': expected a whole number of model instances, at least 1" in proc.stderr
    )


def test_a_token_id_outside_the_vocabulary_is_an_index_error(bert_site: Path, runtime: Runtime) -> None:
    """As eager's: the compiled embedding's own bounds check would end the process (SIGABRT)."""
    manifest = json.loads((bert_site / "bertpkg" / "_aoti" / "manifest.json").read_text())
    assert [leaf.get("index_rows") for leaf in manifest["models"]["bert"]["call"]] == [30522]
    for bad in (30522, -1):
        proc = runtime.run(
            f"import sys, torch; sys.path.insert(0, {str(bert_site)!r}); from bertpkg import compiled\n"
            f"ids = torch.zeros(1, 128, dtype=torch.int64); ids[0, 5] = {bad}\n"
            "compiled.load('bert')(ids)",
            check=False,
        )
        assert proc.returncode == 1, proc.stderr[-2000:]
        assert (
            f"IndexError: compiled model 'bert': input 0 indexes a table of 30522 rows, so its values must be "
            f"in [0, 30522); got {bad}" in proc.stderr
        )


def test_a_bfloat16_model_is_checked_against_a_float64_run(bert_site: Path, runtime: Runtime, tmp_path: Path) -> None:
    """Eager's own bfloat16 rounding is as large as a compiled model's difference from it: the build
    compares both with a float64 run of the same model instead."""
    import torch

    manifest = json.loads((bert_site / "bertpkg" / "_aoti" / "manifest.json").read_text())
    verification = manifest["models"]["llama"]["verification"]
    assert verification["passed"] is True and verification["low_precision"] == ["float64 reference"]
    sys.path.insert(0, str(bert_site))
    try:
        from bertpkg.models import llama
    finally:
        sys.path.remove(str(bert_site))
    ids = torch.randint(0, 1000, (1, 32), generator=torch.Generator().manual_seed(5))
    torch.save(ids, tmp_path / "ids.pt")
    runtime.run(
        f"""
        import sys; sys.path.insert(0, {str(bert_site)!r})
        import torch
        from bertpkg import compiled
        torch.save(compiled.load("llama")(torch.load({str(tmp_path / "ids.pt")!r})), {str(tmp_path / "y.pt")!r})
        """
    )
    compiled = torch.load(tmp_path / "y.pt")
    with torch.no_grad():
        eager = llama()(ids)
    assert compiled.dtype is torch.bfloat16
    from hatch_aoti.worker.verify import Comparison, compare_with_reference, reference

    result = Comparison("test")
    compare_with_reference("logits", eager, compiled, reference(llama(), (ids,), {}), result)
    assert not result.problems, result.problems
