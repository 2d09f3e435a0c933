"""The speed tool: `specaudit bench` times engines on one pair (run.py), counts what every engine
pays (costs.py), and writes bench.json, a markdown summary (report.py) and charts (charts.py)."""
