"""Reports over the results database: metrics (pass@k, fast_p, geomean speedup, % of roofline), tables,
the HTML report, and the suite export. See docs/reports.md."""
