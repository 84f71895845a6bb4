"""benchmarks/report.py: `make bench` writes docs/results.md, one answer per question, and its
plots beside it; a missing input is one line and exit 2, and nothing is written."""
import importlib.util
import json
import pathlib

ROOT = pathlib.Path(__file__).resolve().parents[2]
_spec = importlib.util.spec_from_file_location("bench_report", ROOT / "benchmarks" / "report.py")
report = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(report)


def _bench(tmp_path, scaling=True):
    bench = tmp_path / "bench"
    bench.mkdir()
    rows = [{"bytes": b, "ours_s": 12e-6 * b / 4096, "mpi_s": 6e-6 * b / 4096,
             "ours_min_s": 11e-6, "mpi_min_s": 5e-6, "ours_busbw_GBps": 0.3,
             "mpi_busbw_GBps": 0.6, "ratio": 0.5, "ratio_min": 0.45}
            for b in (4096, 1 << 20)]
    (bench / "allreduce.json").write_text(json.dumps({"ranks": 2, "algo": "auto",
                                                      "results": rows,
                                                      "load_average_at_start": 0.3}))
    best = {"fwd_ms": 3.4, "bwd_ms": 4.3, "update_ms": 0.9, "step_ms": 8.6, "gemm_ms": 8.1,
            "ratio_step_gemm": 1.06, "gflops": 71.8}
    (bench / "step.json").write_text(json.dumps({"argv": ["--model", "mlp", "--torch"],
                                                 "results": [
        {"model": "mlp", "batch": 64, "threads": 1, "blas_gflops": 102.0, "best": best,
         "torch_step_ms": 9.5, "ratio_torch_best": 0.905, "ratio_torch_rounds": [0.9, 0.95, 1.1],
         "torch_version": "2.13.0+cpu"}]}))
    if scaling:
        points = [{"model": "mlp", "ranks": n, "samples_per_sec": 1000.0 * n * e,
                   "speedup": n * e, "efficiency": e, "comm_share": 0.1 * (n - 1)}
                  for n, e in ((1, 1.0), (2, 0.875))]
        (bench / "scaling-weak.json").write_text(json.dumps({"points": points}))
    (bench / "perfmodel.json").write_text(json.dumps({"fit": {"combined": 4e-10}}))
    (bench / "perfmodel.md").write_text("| network | model |\n|---|---|\n| local | mlp |\n")
    return bench


def test_the_page_answers_each_question_once_with_its_plots(tmp_path):
    page = tmp_path / "docs" / "results.md"
    page.parent.mkdir()
    assert report.main(["--bench", str(_bench(tmp_path)), "--out", str(page)]) == 0
    text = page.read_text()
    assert "| mlp | 64 | 1 | 8.60 | 9.50 | 0.91 | 0.95 |" in text       # median of the rounds
    assert "| mlp | 2 | 1750.0 | 1.75 | 0.88 | 10.0% |" in text
    assert "| 4 KiB | 12.0 | 6.0 | 0.50 | 0.300 |  |" in text
    assert "2 / (2 beta + gamma)): 5.00 GB/s" in text                     # the ring's bound
    assert "| local | mlp |" in text and "load average 0.3 as it began" in text
    for section in ("A training step against PyTorch", "Scaling with N",
                    "The allreduce against MPI_Allreduce", "The performance model"):
        assert text.count(f"## {section}") == 1
    for png in ("step", "scaling", "allreduce"):
        assert f"(results/{png}.png)" in text
        assert (page.parent / "results" / f"{png}.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert not list(page.parent.rglob("*.tmp*"))


def test_optional_inputs_are_left_out_not_guessed(tmp_path):
    page = tmp_path / "results.md"
    bench = _bench(tmp_path, scaling=False)
    (bench / "perfmodel.json").unlink()
    assert report.main(["--bench", str(bench), "--out", str(page), "--no-plots"]) == 0
    text = page.read_text()
    assert "## Scaling with N" not in text and "ring's bound" not in text
    assert not (tmp_path / "results").exists()


def test_missing_input_is_one_line_and_exit_2_and_nothing_is_written(tmp_path, capsys):
    page = tmp_path / "results.md"
    assert report.main(["--bench", str(tmp_path / "nothing"), "--out", str(page)]) == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and "allreduce.json not found" in err
    assert not page.exists() and not (tmp_path / "results").exists()
