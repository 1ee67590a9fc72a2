"""Run reports: plots and a Markdown summary from report.json."""
