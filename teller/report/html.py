"""The self-contained HTML report of a diagnosis (inline CSS and JS, no network).

The page shows a timeline of the steps (one lane per rank, each step a bar coloured by its score,
flagged steps outlined), a list of flagged steps, and for the chosen step its candidate families,
its suspects with their evidence and the slice tree with the suspects highlighted. A step is
chosen by clicking it or by the URL fragment ``#step=INDEX`` (the ``index`` in diagnosis.json);
without one the worst flagged step is shown.

For tests and tools the page marks its state in the DOM: ``<body data-ready="1">`` once rendered,
``data-step`` = the step shown, and script errors are listed in ``#errors``.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

_CSS = """
*{box-sizing:border-box}body{font:14px/1.4 system-ui,-apple-system,Segoe UI,Roboto,sans-serif;margin:0;color:#1d2330;background:#f6f7f9}
header{background:#1d2330;color:#fff;padding:12px 20px}header h1{font-size:18px;margin:0 0 4px}header .meta{opacity:.8;font-size:12px}
main{padding:12px 20px}section{background:#fff;border:1px solid #dde1e7;border-radius:6px;padding:12px;margin-bottom:12px}
h2{font-size:15px;margin:0 0 8px}#timeline svg{width:100%;display:block}.step-bar{cursor:pointer}.step-bar.flagged{stroke:#111;stroke-width:1.5}
.step-bar.selected{stroke:#2563eb;stroke-width:3}.legend{font-size:12px;color:#555}.cols{display:flex;gap:12px;align-items:flex-start}
.cols>section{flex:1;min-width:0}table{border-collapse:collapse;width:100%;font-size:13px}td,th{border-bottom:1px solid #eee;padding:3px 6px;text-align:left;vertical-align:top}
tr.pick{cursor:pointer}tr.pick:hover{background:#eef3ff}.badge{display:inline-block;font-size:11px;padding:0 5px;border-radius:3px;margin-right:4px;color:#fff}
.L-STEP{background:#8b3fb5}.L-FE{background:#0e7490}.L-BE{background:#0891b2}.L-COMM{background:#b45309}.L-RT{background:#15803d}
.L-DRV{background:#166534}.L-K{background:#b91c1c}.L-MEM{background:#c2410c}.L-SYNC{background:#9f1239}.L-OTHER{background:#6b7280}
#slice-tree ul{list-style:none;margin:0;padding-left:18px;border-left:1px dotted #ccc}#slice-tree>ul{padding-left:0;border:0}
#slice-tree li{margin:1px 0;white-space:nowrap}.node .dur{color:#666;font-size:12px;margin-left:6px}.node .rel{color:#999;font-size:11px;margin-left:6px}
.suspect>.node{background:#fee2e2;border:1px solid #ef4444;border-radius:3px;padding:0 4px;font-weight:600}
.evidence{font-size:12px;color:#444}.muted{color:#777}#errors{color:#b91c1c;white-space:pre-wrap}.score{font-variant-numeric:tabular-nums}
"""

_JS = r"""
(function(){
var errBox=document.getElementById('errors');
window.addEventListener('error',function(e){errBox.textContent+=(e.message||'error')+'\n';});
var D=JSON.parse(document.getElementById('diagnosis-data').textContent);
function el(tag,attrs,text){var e=document.createElement(tag);if(attrs){for(var k in attrs){if(k==='class')e.className=attrs[k];else e.setAttribute(k,attrs[k]);}}if(text!==undefined&&text!==null)e.textContent=text;return e;}
function svgEl(tag,attrs){var e=document.createElementNS('http://www.w3.org/2000/svg',tag);for(var k in attrs)e.setAttribute(k,attrs[k]);return e;}
function fmtNs(ns){ns=+ns;if(ns>=1e9)return (ns/1e9).toFixed(2)+' s';if(ns>=1e6)return (ns/1e6).toFixed(2)+' ms';if(ns>=1e3)return (ns/1e3).toFixed(1)+' \u00b5s';return Math.round(ns)+' ns';}
function fmtVal(f,v){if(v===null||v===undefined)return '?';if(/_ns$/.test(f))return fmtNs(v);if(/bytes$/.test(f)){if(v>=1048576)return (v/1048576).toFixed(1)+' MiB';if(v>=1024)return (v/1024).toFixed(1)+' KiB';return v+' B';}if(f==='overlap')return Math.round(100*v)+'%';return (+v).toPrecision(3);}
function colour(s){if(s===null||s===undefined)return '#d1d5db';s=Math.max(0,Math.min(1,s));var h=120*(1-s);return 'hsl('+h.toFixed(0)+',75%,'+(s>0.5?45:55)+'%)';}
function evText(it){if(it.note)return it.note;var r=it.ratio?(it.ratio.toFixed(1)+'\u00d7, '):'';return it.feature+' '+fmtVal(it.feature,it.value)+' vs '+fmtVal(it.feature,it.reference)+' ('+r+'z='+(it.z>=0?'+':'')+it.z.toFixed(1)+')';}
var steps=D.steps, byIndex={};steps.forEach(function(s){byIndex[s.index]=s;});
var S=D.summary;
document.getElementById('meta').textContent='run '+D.run+' \u2014 against '+D.reference+' \u2014 '+S.steps+' steps ('+D.steps_rule.rule+'), '+S.steps_flagged+' flagged';
if(D.steps_rule.rule!=='STEP ranges'){var n=el('p',{'class':'muted',id:'steps-rule-note'},'Steps: '+D.steps_rule.detail);document.getElementById('overview').appendChild(n);}
if(S.unseen_families&&S.unseen_families.length){document.getElementById('overview').appendChild(el('p',{'class':'muted',id:'unseen'},'Families not seen in the reference: '+S.unseen_families.join(', ')));}
// timeline
var tl=document.getElementById('timeline');
var ranks=[];steps.forEach(function(s){if(ranks.indexOf(s.rank)<0)ranks.push(s.rank);});ranks.sort(function(a,b){return a-b;});
var t0=Infinity,t1=-Infinity;steps.forEach(function(s){t0=Math.min(t0,s.start_ns);t1=Math.max(t1,s.end_ns);});
var W=1000,laneH=28,H=Math.max(1,ranks.length)*laneH+18,span=Math.max(1,t1-t0);
var svg=svgEl('svg',{viewBox:'0 0 '+(W+40)+' '+H,preserveAspectRatio:'none',height:H,id:'timeline-svg'});
ranks.forEach(function(r,i){var t=svgEl('text',{x:0,y:i*laneH+18,'font-size':11,fill:'#555'});t.textContent='r'+r;svg.appendChild(t);});
var bars={};
steps.forEach(function(s){var i=ranks.indexOf(s.rank);var x=40+W*(s.start_ns-t0)/span;var w=Math.max(1.2,W*(s.end_ns-s.start_ns)/span);
var rc=svgEl('rect',{x:x.toFixed(2),y:i*laneH+4,width:w.toFixed(2),height:laneH-8,fill:colour(s.score),'class':'step-bar'+(s.flag?' flagged':''),'data-index':s.index});
var ti=svgEl('title',{});ti.textContent='step '+s.step_num+' (rank '+s.rank+') '+fmtNs(s.end_ns-s.start_ns)+' score '+(s.score===null?'n/a':s.score.toFixed(2));rc.appendChild(ti);
rc.addEventListener('click',function(){select(s.index,true);});svg.appendChild(rc);bars[s.index]=rc;});
var ax=svgEl('text',{x:40,y:H-2,'font-size':10,fill:'#777'});ax.textContent=fmtNs(0);svg.appendChild(ax);
var ax2=svgEl('text',{x:W+40,y:H-2,'font-size':10,fill:'#777','text-anchor':'end'});ax2.textContent=fmtNs(span);svg.appendChild(ax2);
tl.appendChild(svg);
// flagged list
var fl=document.getElementById('flagged-list');
var flagged=steps.filter(function(s){return s.flag;}).sort(function(a,b){return b.score-a.score||a.start_ns-b.start_ns;});
if(!flagged.length){fl.appendChild(el('p',{'class':'muted'},'No step was flagged.'));}
else{var tb=el('table',{id:'flagged-table'});var hr=el('tr');['step','rank','duration','score','fault type','evidence / why'].forEach(function(h){hr.appendChild(el('th',null,h));});tb.appendChild(hr);
flagged.forEach(function(s){var tr=el('tr',{'class':'pick','data-index':s.index});tr.appendChild(el('td',null,String(s.step_num)));tr.appendChild(el('td',null,String(s.rank)));tr.appendChild(el('td',null,fmtNs(s.end_ns-s.start_ns)));tr.appendChild(el('td',{'class':'score'},s.score.toFixed(2)));var ft=(s.fault_type&&!s.model_says_normal)?(s.fault_type+' (p='+(+s.fault_probability).toFixed(2)+')'):(s.model_says_normal?'normal per model':'\u2014');tr.appendChild(el('td',{'class':'fault-type'},ft));tr.appendChild(el('td',{'class':'why'},s.explanation&&!s.model_says_normal?s.explanation:(s.candidates||[]).map(function(c){return c.family;}).join(', ')));tr.addEventListener('click',function(){select(s.index,true);});tb.appendChild(tr);});fl.appendChild(tb);}
// detail
function renderTree(sl){var box=document.getElementById('slice-tree');box.textContent='';if(!sl||!sl.nodes.length){box.appendChild(el('p',{'class':'muted'},'No slice for this step (it was not flagged).'));return;}
var kids={},ids={};sl.nodes.forEach(function(n){ids[n.id]=n;});var roots=[];
sl.nodes.forEach(function(n){if(n.parent>=0&&ids[n.parent]){(kids[n.parent]=kids[n.parent]||[]).push(n);}else roots.push(n);});
function byStart(a,b){return a.start_ns-b.start_ns;}
function li(n){var item=el('li',{'class':n.suspect?'suspect':'','data-node':n.id});var sp=el('span',{'class':'node'});sp.appendChild(el('span',{'class':'badge L-'+n.layer},n.layer));sp.appendChild(document.createTextNode(n.name));sp.appendChild(el('span',{'class':'dur'},fmtNs(n.dur_ns)));sp.appendChild(el('span',{'class':'rel'},'R='+(n.relevance===null?'-':n.relevance.toFixed(2))));item.appendChild(sp);
var ch=(kids[n.id]||[]).sort(byStart);if(ch.length){var ul=el('ul');ch.forEach(function(c){ul.appendChild(li(c));});item.appendChild(ul);}return item;}
var ul=el('ul');roots.sort(byStart).forEach(function(r){ul.appendChild(li(r));});box.appendChild(ul);
var info=el('p',{'class':'muted'},sl.nodes.length+' nodes; E_p '+sl.edges.p.length+', E_t '+sl.edges.t.length+', E_c '+sl.edges.c.length+' edges'+(sl.dropped?('; '+sl.dropped+' more above threshold left out'):''));box.appendChild(info);}
function select(idx,push){var s=byIndex[idx];if(!s)return;
Object.keys(bars).forEach(function(k){bars[k].classList.remove('selected');});if(bars[idx])bars[idx].classList.add('selected');
document.body.setAttribute('data-step',String(idx));if(push&&history.replaceState)history.replaceState(null,'','#step='+idx);
var h=document.getElementById('step-title');h.textContent='Step '+s.step_num+' (rank '+s.rank+', node '+s.node_id+') \u2014 '+fmtNs(s.end_ns-s.start_ns)+', score '+(s.score===null?'n/a':s.score.toFixed(2))+(s.flag?' \u2014 flagged':'');
var c=document.getElementById('candidates');c.textContent='';
if(s.requests&&s.requests.length)c.appendChild(el('p',{'class':'muted'},'requests: '+s.requests.join(', ')));
if(s.candidates&&s.candidates.length){var t=el('table');var r=el('tr');['family','suspiciousness','instances'].forEach(function(x){r.appendChild(el('th',null,x));});t.appendChild(r);
s.candidates.forEach(function(cd){var tr=el('tr',{'class':'candidate'});tr.appendChild(el('td',null,cd.family+(cd.unseen?' (unseen)':'')));tr.appendChild(el('td',{'class':'score'},cd.suspiciousness===null?'-':cd.suspiciousness.toFixed(2)));tr.appendChild(el('td',null,String(cd.instances)));t.appendChild(tr);});c.appendChild(t);}
else c.appendChild(el('p',{'class':'muted'},'Top family: '+(s.top_family||'none')+' (below the threshold)'));
var sp=document.getElementById('suspects');sp.textContent='';
(s.suspects||[]).forEach(function(x){var d=el('div',{'class':'suspect-item','data-node':x.node_id});d.appendChild(el('b',null,x.family));d.appendChild(document.createTextNode(' node '+x.node_id+', a='+x.a.toFixed(2)+', '+fmtNs(x.dur_ns)));
var ul=el('ul',{'class':'evidence'});x.evidence.forEach(function(it){ul.appendChild(el('li',null,evText(it)));});d.appendChild(ul);sp.appendChild(d);});
if(!(s.suspects||[]).length)sp.appendChild(el('p',{'class':'muted'},'No suspects.'));
renderTree(s.slice);}
var m=/step=(\d+)/.exec(location.hash||'');var first=m?+m[1]:(flagged.length?flagged[0].index:(steps.length?steps.slice().sort(function(a,b){return (b.score||0)-(a.score||0);})[0].index:null));
if(first!==null&&byIndex[first]===undefined&&steps.length)first=steps[0].index;
if(first!==null)select(first,false);
document.body.setAttribute('data-ready','1');
})();
"""

_PAGE = """<!DOCTYPE html>
<html lang="en"><head><meta charset="utf-8"><meta name="viewport" content="width=device-width,initial-scale=1">
<title>TELLER diagnosis</title><style>@@CSS@@</style></head>
<body data-ready="0">
<header><h1>TELLER diagnosis</h1><div class="meta" id="meta"></div></header>
<main>
<div id="errors"></div>
<section id="overview"><h2>Steps over time</h2>
<div id="timeline"></div>
<div class="legend">Each bar is a step (one lane per rank), coloured from green (normal) to red (score 1); outlined: flagged. Click a step.</div>
</section>
<div class="cols">
<section id="flagged"><h2>Flagged steps</h2><div id="flagged-list"></div></section>
<section id="detail"><h2 id="step-title">Step</h2><div id="candidates"></div><h2>Suspects</h2><div id="suspects"></div></section>
</div>
<section id="slice"><h2>Slice tree (suspects highlighted)</h2><div id="slice-tree"></div></section>
</main>
<script type="application/json" id="diagnosis-data">@@DATA@@</script>
<script>@@JS@@</script>
</body></html>
"""


def page_data(diag: dict[str, Any]) -> dict[str, Any]:
    """What the page needs from a diagnosis (the full dict minus bulky localizer details)."""
    keep = ("run", "reference", "steps_rule", "instance_layers", "summary", "steps")
    return {k: diag[k] for k in keep if k in diag}


def render_html(diag: dict[str, Any]) -> str:
    """The report page as one HTML string."""
    data = json.dumps(page_data(diag), separators=(",", ":"), allow_nan=False)
    data = data.replace("<", "\\u003c").replace(">", "\\u003e").replace("&", "\\u0026")
    return _PAGE.replace("@@CSS@@", _CSS).replace("@@JS@@", _JS).replace("@@DATA@@", data)


def write_html(diag: dict[str, Any], path: str | os.PathLike) -> Path:
    """Write the report page (atomically) and return its path."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".html.tmp")
    tmp.write_text(render_html(diag), encoding="utf-8")
    tmp.replace(path)
    return path
