"""A one-page live view of /admin/status (no build step, no external assets)."""

DASHBOARD_HTML = """<!doctype html>
<html lang="en"><head><meta charset="utf-8"><title>triage-proxy</title>
<style>
body{font:14px system-ui,sans-serif;margin:2em;color:#222}
h1{font-size:1.3em} h2{font-size:1.05em;margin-top:1.5em}
table{border-collapse:collapse} td,th{border:1px solid #ccc;padding:.3em .7em;text-align:right}
th{background:#f4f4f4} td:first-child,th:first-child{text-align:left}
.open{color:#b00;font-weight:bold} .half_open{color:#b70} .closed{color:#070}
pre{background:#f8f8f8;padding:1em;overflow:auto;max-height:30em}
</style></head><body>
<h1>triage-proxy</h1><div id="updated"></div>
<h2>Providers</h2><table id="providers"></table>
<h2>Breakers</h2><table id="breakers"></table>
<h2>Scheduler</h2><pre id="scheduler"></pre>
<script>
function row(cells, tag){const tr=document.createElement('tr');
  for(const c of cells){const td=document.createElement(tag||'td');
    if(c&&c.cls){td.className=c.cls;td.textContent=c.text}else{td.textContent=c}
    tr.appendChild(td)}return tr}
async function refresh(){
  try{
    const s=await (await fetch('/admin/status')).json();
    const p=document.getElementById('providers');p.replaceChildren(
      row(['provider','kind','inflight','limit','max'],'th'),
      ...Object.entries(s.providers).map(([n,v])=>row([n,v.kind,v.inflight,v.limit,v.max_concurrency])));
    const b=document.getElementById('breakers');b.replaceChildren(
      row(['deployment','state'],'th'),
      ...Object.entries(s.breakers).map(([n,v])=>row([n,{cls:v.state,text:v.state}])));
    document.getElementById('scheduler').textContent=JSON.stringify(s.scheduler,null,2);
    document.getElementById('updated').textContent='updated '+new Date().toLocaleTimeString();
  }catch(e){document.getElementById('updated').textContent='unreachable: '+e}
}
refresh();setInterval(refresh,1000);
</script></body></html>
"""
