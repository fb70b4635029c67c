"""Graph files are data: a crafted `.json`, `.pt2` or `.py` graph runs no code without --trust-code.

Each case plants a payload that would create a marker file if any of it ran (in FX's generated
code, an unpickle, a resolved attribute path, a sympy parse) and loads the file the way a user
does: `k3c run --graph`, `explain --graph`, `bisect --graph`, and a dump folder holding the file as
graph.json. It must exit non-zero with one error line, and the marker must stay absent.
"""
from __future__ import annotations

import copy
import io
import json
import pathlib
import zipfile

import pytest
import torch
from typer.testing import CliRunner

from k3compile.cli import app
from k3compile.cli import graphio


def k3c(*args):
    return CliRunner().invoke(app, [str(a) for a in args])


def refused(r, marker: pathlib.Path, code: int = 1):
    assert r.exit_code == code, (r.exit_code, r.output, r.exception)
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("k3c: error: "), r.stderr
    assert "Traceback" not in r.output
    assert not marker.exists(), "the payload ran"
    return lines[0]


def payload(marker: pathlib.Path) -> str:
    """A Python expression that creates `marker`, with no dots (attribute paths are split at them)."""
    code = f"open({str(marker)!r}, 'w')"
    return f"eval(str(bytes({list(code.encode())}), 'ascii'))"


class Evil:
    """Unpickling this runs the payload (what `torch.load(weights_only=False)` would do)."""

    def __init__(self, marker):
        self.marker = str(marker)

    def __reduce__(self):
        return (exec, (f"import pathlib; pathlib.Path({self.marker!r}).touch()",))


# ----------------------------------------------------------------------------------------- .json
@pytest.fixture(scope="module")
def good_json(tmp_path_factory) -> dict:
    """A valid k3c graph: x @ w + b in ATen ops, saved by the writer `k3c run --dump` uses."""
    from torch.fx.experimental.proxy_tensor import make_fx

    gm = make_fx(lambda x, w: torch.ops.aten.add.Tensor(torch.ops.aten.mm.default(x, w), 1.0))(
        torch.randn(2, 4), torch.randn(4, 4))
    p = tmp_path_factory.mktemp("g") / "good.json"
    graphio.save_json(gm.graph, p)
    return json.loads(p.read_text())


def node(doc, op):
    return next(n for n in doc["nodes"] if n["op"] == op)


def _placeholder_target(doc, m):
    [n for n in doc["nodes"] if n["op"] == "placeholder"][-1]["target"] = f"w=({payload(m)})"


def _get_attr_target(doc, m):
    doc["nodes"].insert(2, {"name": "c", "op": "get_attr", "target": GET_ATTR.format(payload(m)),
                            "args": {"tuple": []}, "kwargs": {"dict": {}}})


GET_ATTR = 'a"),{},getattr(self,"b'


def _node_name(doc, m):
    node(doc, "call_function")["name"] = f"y = {payload(m)}; z"


def _op_namespace(doc, m):
    node(doc, "call_function")["target"] = {"op": "os::system.default"}


def _op_attribute_path(doc, m):
    node(doc, "call_function")["target"] = {"op": "__class__::__init__.__globals__"}


def _python_function(doc, m):
    node(doc, "call_function")["target"] = {"py": "builtins.exec"}


def _higher_order_op(doc, m):
    node(doc, "call_function")["target"] = {"hop": "run_const_graph"}


def _kwarg_name(doc, m):
    node(doc, "call_function")["kwargs"] = {"dict": {f"alpha=({payload(m)}), beta": 1}}


def _arg_layout(doc, m):
    node(doc, "call_function")["args"]["tuple"].append({"layout": "load"})


def _stack_trace(doc, m):
    doc["stack_traces"] = [f'File "a.py", line 1, in f\n    x\r{payload(m)}\n']
    node(doc, "call_function")["stack_trace"] = 0


def _output_target(doc, m):
    node(doc, "output")["target"] = payload(m)


JSON_ROUTES = [_placeholder_target, _get_attr_target, _node_name, _op_namespace,
               _op_attribute_path, _python_function, _higher_order_op, _kwarg_name, _arg_layout,
               _stack_trace, _output_target]


@pytest.mark.parametrize("route", JSON_ROUTES, ids=lambda f: f.__name__.strip("_"))
def test_crafted_json_graph_runs_nothing(good_json, tmp_path, route):
    marker = tmp_path / "PWNED"
    doc = copy.deepcopy(good_json)
    route(doc, marker)
    f = tmp_path / "g.json"
    f.write_text(json.dumps(doc))
    # saved inputs (and the constant a get_attr reads), so that a graph that loads is also run
    torch.save({"args": [torch.randn(2, 4), torch.randn(4, 4)],
                "constants": {GET_ATTR.format(payload(marker)): torch.zeros(1)}}, tmp_path / "g.inputs.pt")
    refused(k3c("run", "--graph", f, "--dump", tmp_path / "out"), marker)  # --dump writes readable graphs
    # the same file behind every command that takes a graph, and as a dump folder's graph.json
    (tmp_path / "dump").mkdir()
    (tmp_path / "dump" / "graph.json").write_text(f.read_text())
    refused(k3c("run", "--graph", tmp_path / "dump"), marker)
    refused(k3c("explain", "fuse_oproj_allreduce", "--graph", f), marker)
    refused(k3c("bisect", "--graph", f), marker)


def test_string_arguments_stay_data(good_json, tmp_path):
    """A string argument is quoted in FX's code: a file that passes one is loaded, and nothing runs."""
    marker = tmp_path / "PWNED"
    doc = copy.deepcopy(good_json)
    node(doc, "call_function")["args"]["tuple"].append(f"'); {payload(marker)}; ('")
    f = tmp_path / "g.json"
    f.write_text(json.dumps(doc))
    gm = graphio.load(f).gm
    assert payload(marker) in gm.code  # inside a quoted string
    assert not marker.exists()


def test_valid_json_graph_still_loads(good_json, tmp_path):
    f = tmp_path / "g.json"
    f.write_text(json.dumps(good_json))
    lg = graphio.load(f)
    assert [n.op for n in lg.gm.graph.nodes] == ["placeholder", "placeholder", "call_function", "call_function",
                                                 "output"]


# ----------------------------------------------------------------------------------------- .pt2
class _Small(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.w = torch.nn.Parameter(torch.randn(4, 4))
        self.register_buffer("b", torch.ones(4))
        self.c = torch.tensor([1.0, 2.0, 3.0, 4.0])  # a tensor constant

    def forward(self, x):
        return x @ self.w + self.b + self.c


@pytest.fixture(scope="module")
def good_pt2(tmp_path_factory) -> pathlib.Path:
    p = tmp_path_factory.mktemp("pt2") / "good.pt2"
    torch.export.save(torch.export.export(_Small(), (torch.randn(2, 4),)), p)
    return p


def rewrite(src: pathlib.Path, dst: pathlib.Path, edit) -> None:
    """Copy the archive, letting `edit(members)` change {name under the top folder: bytes}."""
    with zipfile.ZipFile(src) as z:
        top = z.namelist()[0].split("/", 1)[0]
        members = {n.split("/", 1)[1]: z.read(n) for n in z.namelist()}
    edit(members)
    with zipfile.ZipFile(dst, "w") as z:
        for n, b in members.items():
            z.writestr(f"{top}/{n}", b)


def pickled(obj) -> bytes:
    buf = io.BytesIO()
    torch.save(obj, buf)
    return buf.getvalue()


def _json_edit(members, name, fn):
    d = json.loads(members[name])
    fn(d)
    members[name] = json.dumps(d).encode()


def _pickled_weight(m, marker):
    def fn(d):
        d["config"]["w"]["use_pickle"] = True
    _json_edit(m, "data/weights/model_weights_config.json", fn)
    m["data/weights/weight_0"] = pickled(Evil(marker))


def _pickled_constant(m, marker):
    def fn(d):
        d["config"]["c"]["use_pickle"] = True
    _json_edit(m, "data/constants/model_constants_config.json", fn)
    m["data/constants/tensor_0"] = pickled(Evil(marker))


def _custom_object_constant(m, marker):
    def fn(d):
        d["config"]["c"]["path_name"] = "opaque_obj_0"
    _json_edit(m, "data/constants/model_constants_config.json", fn)
    m["data/constants/opaque_obj_0"] = pickled(Evil(marker))


def _sample_inputs(m, marker):
    m["data/sample_inputs/model.pt"] = pickled(((Evil(marker),), {}))


def _legacy_weights(m, marker):
    m["data/weights/model.pt"] = pickled(Evil(marker))


def _compiled_code(m, marker):
    m["data/aotinductor/model/model.so"] = b"\x7fELF"


def _node_target(m, marker):
    def fn(d):
        d["graph_module"]["graph"]["nodes"][0]["target"] = "torch.serialization.pickle.loads"
    _json_edit(m, "models/model.json", fn)


def _sym_expr(m, marker):
    def fn(d):
        d["graph_module"]["graph"]["tensor_values"]["x"]["sizes"][0] = {
            "as_expr": {"expr_str": payload(marker), "hint": {"as_int": 2}}}
    _json_edit(m, "models/model.json", fn)


def _placeholder_name(m, marker):
    def fn(d):
        g = d["graph_module"]["graph"]
        g["inputs"][-1]["as_tensor"]["name"] = f"x=({payload(marker)})"
    _json_edit(m, "models/model.json", fn)


PT2_ROUTES = [_pickled_weight, _pickled_constant, _custom_object_constant, _sample_inputs, _legacy_weights,
              _compiled_code, _node_target, _sym_expr, _placeholder_name]


@pytest.mark.parametrize("route", PT2_ROUTES, ids=lambda f: f.__name__.strip("_"))
def test_crafted_pt2_runs_nothing(good_pt2, tmp_path, route):
    marker = tmp_path / "PWNED"
    f = tmp_path / "evil.pt2"
    rewrite(good_pt2, f, lambda m: route(m, marker))
    line = refused(k3c("run", "--graph", f), marker)
    assert "--trust-code" in line or "not an op" in line or "not a" in line, line
    refused(k3c("bisect", "--graph", f), marker)


def test_pickled_pt2_loads_with_trust_code(good_pt2, tmp_path):
    """--trust-code opens what the check refuses: the user has said the file is theirs."""
    f = tmp_path / "pickled.pt2"

    def edit(m):  # a pickled weight that is a real tensor (what torch.export.save writes for some)
        _json_edit(m, "data/weights/model_weights_config.json",
                   lambda d: d["config"]["w"].__setitem__("use_pickle", True))
        m["data/weights/weight_0"] = pickled(torch.nn.Parameter(torch.randn(4, 4)))
    rewrite(good_pt2, f, edit)
    with pytest.raises(graphio.UntrustedCodeError):
        graphio.load(f)
    assert graphio.load(f, trust_code=True).kind == "torch.export"


def test_valid_pt2_still_loads(good_pt2):
    lg = graphio.load(good_pt2)
    assert lg.kind == "torch.export" and lg.inputs is not None


# ----------------------------------------------------------------------------------------- .py
def test_python_graph_runs_nothing_without_trust_code(tmp_path):
    marker = tmp_path / "PWNED"
    f = tmp_path / "g.py"
    f.write_text(payload(marker) + "\n")
    line = refused(k3c("run", "--graph", f), marker)
    assert "--trust-code" in line
