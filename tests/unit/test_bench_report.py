"""benchmarks/report.py: `make bench` refreshes only the generated block of docs/benchmarks.md."""
import importlib.util
import json
import pathlib

ROOT = pathlib.Path(__file__).resolve().parents[2]
_spec = importlib.util.spec_from_file_location("bench_report", ROOT / "benchmarks" / "report.py")
report = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(report)


def _bench(tmp_path):
    bench = tmp_path / "bench"
    bench.mkdir()
    row = {"bytes": 4096, "ours_s": 12e-6, "mpi_s": 6e-6, "ours_min_s": 11e-6, "mpi_min_s": 5e-6,
           "ours_busbw_GBps": 0.3, "ratio": 0.5, "ratio_min": 0.45}
    (bench / "allreduce.json").write_text(json.dumps({"ranks": 2, "algo": "auto",
                                                      "results": [row],
                                                      "load_average_at_start": 0.3}))
    best = {"fwd_ms": 3.4, "bwd_ms": 4.3, "update_ms": 0.9, "step_ms": 8.6, "gemm_ms": 8.1,
            "ratio_step_gemm": 1.06, "gflops": 71.8}
    (bench / "step.json").write_text(json.dumps({"argv": ["--model", "mlp"], "results": [
        {"model": "mlp", "batch": 64, "threads": 1, "blas_gflops": 102.0, "best": best}]}))
    (bench / "scaling-weak.md").write_text("| model | N |\n|---|---|\n| mlp | 2 |\n")
    return bench


def test_first_run_appends_then_reruns_replace_only_the_block(tmp_path):
    bench = _bench(tmp_path)
    doc = tmp_path / "benchmarks.md"
    doc.write_text("# Benchmarks\n\nhand-written analysis\n")
    assert report.main(["--bench", str(bench), "--doc", str(doc)]) == 0
    first = doc.read_text()
    assert first.startswith("# Benchmarks\n\nhand-written analysis\n")
    assert "| 4096 | 12.0 (11.0) | 6.0 (5.0) | 0.300 | 0.50 (0.45) |" in first
    assert "| mlp | 64 | 1 | 3.40 | 4.30 | 0.90 | 8.60 | 8.10 | 1.06 | 71.8 | 102.0 |" in first
    assert "| mlp | 2 |" in first
    assert "(load average 0.3 as it began)" in first      # the machine before the benchmarks
    doc.write_text(first + "\ntail text\n")
    (bench / "scaling-weak.md").write_text("| model | N |\n|---|---|\n| lenet | 4 |\n")
    assert report.main(["--bench", str(bench), "--doc", str(doc)]) == 0
    second = doc.read_text()
    assert second.count(report.BEGIN) == 1 and second.count(report.END) == 1
    assert "| lenet | 4 |" in second and "| mlp | 2 |" not in second
    assert second.endswith("\ntail text\n") and "hand-written analysis" in second


def test_missing_input_is_one_line_and_exit_2_and_the_doc_is_untouched(tmp_path, capsys):
    doc = tmp_path / "benchmarks.md"
    doc.write_text("# Benchmarks\n")
    assert report.main(["--bench", str(tmp_path / "nothing"), "--doc", str(doc)]) == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and "allreduce.json not found" in err
    assert doc.read_text() == "# Benchmarks\n"
