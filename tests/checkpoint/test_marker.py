"""planc.json and plan.yaml: the plan a checkpoint was saved under, rebuilt from the CompiledPlan."""

import json

import pytest
import yaml

from planc import compile as planc_compile
from planc.checkpoint.marker import is_planc_checkpoint, plan_mapping, read_marker, saved_under
from planc.errors import CheckpointError
from planc.models.build import build_tiny_model
from tests.checkpoint.workers import plan_for


@pytest.mark.parametrize(("model_type", "kind"), [("mixtral", "ep"), ("mixtral", "packed"), ("deepseek_v3", "ep")])
def test_rebuilt_plan_compiles_to_the_same_fingerprint(model_type, kind):
    model = build_tiny_model(model_type)
    compiled = planc_compile(model, plan_for(kind, model_type, 2))
    text = yaml.safe_dump(plan_mapping(compiled), sort_keys=False)
    again = planc_compile(model, text)  # YAML text goes through the linter like a plan file
    assert again.fingerprint == compiled.fingerprint


def test_marker_detection_and_errors(tmp_path):
    assert not is_planc_checkpoint(tmp_path)
    with pytest.raises(CheckpointError, match="has no planc.json"):
        read_marker(tmp_path)
    (tmp_path / "planc.json").write_text("{not json")
    assert not is_planc_checkpoint(tmp_path)
    with pytest.raises(CheckpointError, match="not valid JSON"):
        read_marker(tmp_path)
    (tmp_path / "planc.json").write_text(json.dumps({"format": "planc-dcp", "format_version": 99}))
    assert is_planc_checkpoint(tmp_path)
    with pytest.raises(CheckpointError, match="format_version 99"):
        read_marker(tmp_path)


def test_messages_name_an_unnamed_plan_as_such():
    assert saved_under({"plan_name": "mixtral-tp2", "fingerprint": "ab"}) == "saved under plan 'mixtral-tp2', fingerprint ab"
    assert saved_under({"plan_name": None, "plan_path": "p.yaml", "fingerprint": "ab"}).startswith("saved under the plan in p.yaml")
    assert saved_under({"plan_name": None, "plan_path": None, "fingerprint": "ab"}) == (
        "saved under an unnamed plan, fingerprint ab")
