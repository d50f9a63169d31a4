"""The kernel contract: every prompt kernel's rows against the decode kernel it replaces, as bytes.

    check.py    the section (run_section, check_set, check_pair): our kernel sets on synthetic calls
    calls.py    contract_of_calls: the same claim on recorded calls (a dump set of any engine, ours included)
    cases.py    the cases fed to each pair; inputs.py: random and captured inputs per class and call site
    combine.py  coverage and merging parts computed separately; report.py: tables, plots and render_md
"""
