"""The FP64 per-class receipt.

    section.py  the section (run_section, render_md)
    ref.py      FP64 references and error bounds per class; cert.py: certification of the references
    synth.py    synthetic input sets; report.py: tables and plots
"""
