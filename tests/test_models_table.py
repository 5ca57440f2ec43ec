"""bench.models_table: the README's table of real models, from bench-models' JSON."""
import json

from bench.models_table import paired_table, table


def test_a_row_per_run_with_shares_and_ratios_and_dashes_for_what_did_not_run(tmp_path):
    def job(provider, steps_per_s):
        return {"config": {"provider": provider, "model": "resnet50"},
                "summary": {"steps_per_s": steps_per_s, "median_step_ms": 1000.0 / steps_per_s}}
    path = tmp_path / "resnet50.json"
    path.write_text(json.dumps({"jobs": [job("none", 5.0), job("shm", 4.0), job("tf-grpc", 1.6),
                                         job("horovod", 2.5)]}))
    other = tmp_path / "vgg16.json"
    other.write_text(json.dumps({"jobs": [{**job("none", 3.0), "config": {"provider": "none", "model": "vgg16"}},
                                          {**job("tcp", 2.0), "config": {"provider": "tcp", "model": "vgg16"}}]}))
    lines = table([str(path), str(other)]).splitlines()
    assert lines[0] == ("| model | floor | rdmatensor shm | rdmatensor tcp | TensorFlow's own | Horovod (gloo) "
                        "| shm: of floor | shm vs TF's own | shm vs Horovod |") and len(lines) == 4
    assert lines[2] == "| ResNet50 | 5.00 | 4.00 | – | 1.60 | 2.50 | 80% | 2.50x | 1.60x |"
    assert lines[3] == "| VGG16 | 3.00 | – | 2.00 | – | – | – | – | – |"      # no grpc or sync column at all


def test_rounds_show_medians_and_the_range_of_each_share_taken_within_its_round(tmp_path):
    def job(provider, steps_per_s, k):
        return {"config": {"provider": provider, "model": "densenet121"}, "round": k,
                "summary": {"steps_per_s": steps_per_s, "median_step_ms": 1000.0 / steps_per_s}}
    path = tmp_path / "densenet121.json"
    jobs = [job("none", 10.0, 0), job("sync", 9.5, 0), job("shm", 9.0, 0),
            job("none", 5.0, 1), job("sync", 5.0, 1), job("shm", 4.0, 1),
            job("none", 8.0, 2), job("sync", 8.0, 2), job("shm", 6.8, 2)]
    path.write_text(json.dumps({"rounds": 3, "jobs": jobs}))
    header, _, line = table([str(path)]).splitlines()
    assert header == "| model | floor | sync floor | rdmatensor shm | shm: of floor | shm: of sync floor |"
    # steps/s: medians over rounds; shares: 90%, 80%, 85% within the rounds
    assert line == "| DenseNet121 | 8.00 | 8.00 | 6.80 | 85% (80%–90%) | 85% (80%–95%) |"


def test_paired_jobs_give_one_row_each_with_both_floors_and_the_shares(tmp_path):
    paired = {"cycles": 60, "none_ms": 42.25, "sync_ms": 46.9, "provider_ms": 52.3, "of_floor": 0.804,
              "of_sync": 0.876, "sync_of_floor": 0.913}
    path = tmp_path / "mobilenetv2.json"
    path.write_text(json.dumps({"jobs": [
        {"config": {"provider": "shm", "model": "mobilenetv2"}, "summary": {"paired": paired}},
        {"config": {"provider": "tcp", "model": "mobilenetv2"}, "summary": {"paired": None}}]}))
    lines = paired_table([str(path)]).splitlines()
    assert lines[0] == ("| model | provider | floor ms | sync floor ms | provider ms | of floor | of sync floor "
                        "| sync floor: of floor | cycles | beside it |") and len(lines) == 3    # no row unpaired
    assert lines[2] == "| MobileNetV2 | shm | 42.2 | 46.9 | 52.3 | 80% | 88% | 91% | 60 | – |"
    # the Python path timed in the native job's turns: a row of its own, the ratio on the provider's
    paired.update({"hvd-python_ms": 60.0, "hvd-python_of_floor": 0.70, "hvd-python_of_sync": 0.78,
                   "of_hvd-python": 1.147})
    path.write_text(json.dumps({"jobs": [{"config": {"provider": "hvd", "model": "mobilenetv2"},
                                          "summary": {"paired": paired}}]}))
    lines = paired_table([str(path)]).splitlines()
    assert lines[2:] == [
        "| MobileNetV2 | hvd | 42.2 | 46.9 | 52.3 | 80% | 88% | 91% | 60 | hvd-python step 1.15x |",
        "| MobileNetV2 | hvd-python (in hvd's turns) | 42.2 | 46.9 | 60.0 | 70% | 78% | 91% | 60 | – |"]


def test_paired_rounds_of_one_model_give_one_row_of_medians_and_ranges(tmp_path):
    def job(floor_ms, provider_ms, python_ms, cycles):
        return {"config": {"provider": "hvd", "model": "vgg16"}, "summary": {"paired": {
            "cycles": cycles, "none_ms": floor_ms, "sync_ms": 110.0, "provider_ms": provider_ms,
            "of_floor": floor_ms / provider_ms, "of_sync": 110 / provider_ms, "sync_of_floor": 0.9,
            "hvd-python_ms": python_ms, "hvd-python_of_floor": floor_ms / python_ms,
            "hvd-python_of_sync": 110 / python_ms, "of_hvd-python": python_ms / provider_ms}}}
    path = tmp_path / "vgg16.json"
    path.write_text(json.dumps({"jobs": [job(100.0, 125.0, 150.0, 30), job(90.0, 200.0, 200.0, 30),
                                         job(96.0, 160.0, 176.0, 29)]}))
    lines = paired_table([str(path)]).splitlines()
    assert lines[2:] == [
        "| VGG16 | hvd | 96.0 (90.0–100.0) | 110.0 (110.0–110.0) | 160.0 (125.0–200.0) | 60% (45%–80%) "
        "| 69% (55%–88%) | 90% (90%–90%) | 30+30+29 | hvd-python step 1.10x (1.00x–1.20x) |",
        "| VGG16 | hvd-python (in hvd's turns) | 96.0 (90.0–100.0) | 110.0 (110.0–110.0) | 176.0 (150.0–200.0) "
        "| 55% (45%–67%) | 62% (55%–73%) | 90% (90%–90%) | 30+30+29 | – |"]


def test_the_readmes_table_is_what_its_command_prints():
    """The README's first table is bench.models_table's output for the committed JSON it names."""
    import pathlib
    import re
    root = pathlib.Path(__file__).resolve().parents[1]
    readme = (root / "README.md").read_text()
    files = re.search(r"python -m bench\.models_table docs/models/rounds/\{([a-z0-9,]+)\}\.json", readme).group(1)
    printed = table([str(root / "docs" / "models" / "rounds" / f"{m}.json") for m in files.split(",")])
    section = readme.split("## How it does", 1)[1].split("## Layout", 1)[0]
    assert printed in section
