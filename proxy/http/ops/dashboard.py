"""The dashboard: one self-contained page (inline CSS and JavaScript, charts in inline SVG,
no external assets, no build step) fed by ``/admin/events``.

It reads the stream with ``fetch`` (not ``EventSource``, which cannot send a header), so
it can send the admin key as ``X-Admin-Key``: on a 401 it asks for the key and keeps it in
``sessionStorage``. Every number it shows sits in an element with a stable id or a
``data-field`` / ``data-value`` attribute (the raw number), for the tests to read.
The script is ``dashboard.js`` beside this module, a file of the package.
"""

from __future__ import annotations

import importlib.resources

_PAGE = r"""<!doctype html>
<html lang="en"><head><meta charset="utf-8">
<meta name="viewport" content="width=device-width, initial-scale=1">
<title>triage-proxy dashboard</title>
<style>
:root{--bg:#f5f6f8;--card:#fff;--ink:#1d2330;--dim:#6b7385;--line:#e3e6ec}
*{box-sizing:border-box}
body{margin:0;padding:16px 20px;background:var(--bg);color:var(--ink);
  font:13px/1.35 system-ui,-apple-system,"Segoe UI",Roboto,sans-serif}
header{display:flex;align-items:baseline;gap:14px;flex-wrap:wrap;margin-bottom:12px}
h1{font-size:18px;margin:0}
h2{font-size:13px;margin:0 0 6px;color:var(--dim);font-weight:600;text-transform:uppercase;
  letter-spacing:.04em}
#conn{padding:2px 8px;border-radius:10px;background:#e6e8ee;font-size:12px}
#conn[data-state=live]{background:#dff3e4;color:#17602a}
#conn[data-state=error]{background:#fbe3e1;color:#9b1c12}
#meta{color:var(--dim)}
#keyform{background:var(--card);border:1px solid var(--line);border-radius:8px;padding:14px;
  margin-bottom:12px;display:flex;gap:8px;align-items:center}
#keyform[hidden]{display:none}
#keyerror{color:#9b1c12}
.cards{display:grid;grid-template-columns:repeat(auto-fit,minmax(150px,1fr));gap:10px;
  margin-bottom:12px}
.card,.panel{background:var(--card);border:1px solid var(--line);border-radius:8px;
  padding:10px 12px}
.card .label{color:var(--dim);font-size:12px}
.card .value{font-size:22px;font-weight:600;font-variant-numeric:tabular-nums}
.grid{display:grid;grid-template-columns:repeat(auto-fit,minmax(420px,1fr));gap:10px;
  margin-bottom:12px}
svg.chart{width:100%;height:auto;display:block}
svg .grid{stroke:var(--line);stroke-width:1}
svg text{font-size:10px;fill:var(--dim);font-family:inherit}
svg .ylabel{text-anchor:end} svg .xlabel{text-anchor:middle}
svg .line{fill:none;stroke-width:1.8;stroke-linejoin:round;stroke-linecap:round}
.legend{display:flex;flex-wrap:wrap;gap:4px 14px;margin-top:4px;font-size:12px}
.legend span{display:inline-flex;align-items:center;gap:5px}
.legend i{width:10px;height:10px;border-radius:2px;display:inline-block}
.legend b{font-weight:600;font-variant-numeric:tabular-nums}
table{border-collapse:collapse;width:100%;font-variant-numeric:tabular-nums}
th,td{padding:4px 8px;border-bottom:1px solid var(--line);text-align:right;white-space:nowrap}
th{color:var(--dim);font-weight:600;font-size:12px}
th:first-child,td:first-child,th.text,td.text{text-align:left}
.closed{color:#17602a}.half_open{color:#a35c00;font-weight:600}.open{color:#b3180c;font-weight:700}
.s4xx{color:#a35c00}.s5xx{color:#b3180c}
.empty{color:var(--dim);text-align:left}
</style></head>
<body data-ticks="0">
<header><h1>triage-proxy</h1><span id="conn" data-state="connecting">connecting</span>
<span id="meta"></span></header>
<form id="keyform" hidden><label for="adminkey">Admin key</label>
<input id="adminkey" type="password" autocomplete="off" size="32">
<button type="submit">Connect</button><span id="keyerror"></span></form>
<div class="cards">
<div class="card"><div class="label">queued</div><div class="value" id="queued">-</div></div>
<div class="card"><div class="label">in flight / limit</div>
<div class="value" id="slots">-</div></div>
<div class="card"><div class="label">calls / s</div><div class="value" id="rate">-</div></div>
<div class="card"><div class="label">upstream 429s</div>
<div class="value" id="throttled">-</div></div>
<div class="card"><div class="label">4xx + 5xx in view</div>
<div class="value" id="refused">-</div></div>
<div class="card"><div class="label">spend</div><div class="value" id="spend">-</div></div>
</div>
<div class="grid">
<div class="panel"><h2>Queue depth per tier</h2><svg class="chart" id="chart-depth"></svg>
<div class="legend" id="legend-depth"></div></div>
<div class="panel"><h2>Queue wait p50 per tier</h2><svg class="chart" id="chart-p50"></svg>
<div class="legend" id="legend-p50"></div></div>
<div class="panel"><h2>Queue wait p99 per tier</h2><svg class="chart" id="chart-p99"></svg>
<div class="legend" id="legend-p99"></div></div>
<div class="panel"><h2>Calls per second by status</h2><svg class="chart" id="chart-calls"></svg>
<div class="legend" id="legend-calls"></div></div>
<div class="panel"><h2>Slots in use per provider</h2><svg class="chart" id="chart-inflight"></svg>
<div class="legend" id="legend-inflight"></div></div>
</div>
<div class="grid">
<div class="panel"><h2>Tiers</h2><table id="tiers"></table></div>
<div class="panel"><h2>Keys: their share of their tier lately</h2><table id="keys"></table></div>
<div class="panel"><h2>Providers</h2><table id="providers"></table></div>
</div>
<div class="grid">
<div class="panel"><h2>Tokens and cost per key and tier</h2><table id="usage"></table></div>
<div class="panel"><h2>Recent rejections</h2><table id="rejections"></table></div>
<div class="panel"><h2>Batches running</h2><table id="batches"></table></div>
</div>
<script>
"""

SCRIPT = (importlib.resources.files(__package__) / "dashboard.js").read_text("utf-8")
DASHBOARD_HTML = _PAGE + SCRIPT + "</script></body></html>\n"
