"""What a person reads: report.md (markdown.py), the self-contained report.html (html.py), the
diagnosis section (diagnosis.py), the terminal summary (summary.py) and the charts (charts.py)."""
