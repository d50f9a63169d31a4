"""The receipt harness.

    sections.py  THE section table (every per-section fact: params class, preflight facts, summary columns, diff);
                 params.py: typed parameters; profiles.py: run profiles
    preflight.py, overrides.py: a run's parameters and the checks before anything runs; runner.py + runfolder.py:
                 the papermill run into one folder
    render.py    receipt.md; page.py: receipt.html; tables.py: table formatting; env.py: the environment record
    diff.py      what moved between two receipts (diff_md.py: markdown, diff_bench.py: speed, diff_cli.py: the
                 command); comment.py: the PR comment; cli.py: python -m exactness
"""
