"""`python -m app.bench_report DIR`, kept for scripts: redraws a result directory's plots
(`bench.report`, also `python -m bench.report DIR`)."""

import sys
from pathlib import Path

from bench.report import plot_dir

if __name__ == "__main__":
    plot_dir(Path(sys.argv[1]))
