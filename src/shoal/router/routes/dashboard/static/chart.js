// The activity chart, drawn by hand on a <canvas>: tokens/s (left axis, filled) and
// requests/s (right axis) over a sliding time window. Colours come from CSS variables.

// The top of an axis with four gridlines at round values: 4 × (1, 2, 2.5 or 5 × 10^k).
export function niceMax(value) {
  if (!(value > 0)) return 1;
  const rough = value / 4;
  const power = 10 ** Math.floor(Math.log10(rough));
  return 4 * [1, 2, 2.5, 5, 10].map((m) => m * power).find((step) => step >= rough);
}

const axisLabel = (v) => String(Number(v.toPrecision(3)));

function drawSeries(ctx, points, x, y, color, fill) {
  if (!points.length) return;
  ctx.beginPath();
  points.forEach((p, i) => (i ? ctx.lineTo(x(p.t), y(p)) : ctx.moveTo(x(p.t), y(p))));
  ctx.strokeStyle = color;
  ctx.lineWidth = 2;
  ctx.stroke();
  if (!fill) return;
  ctx.lineTo(x(points[points.length - 1].t), y(null));
  ctx.lineTo(x(points[0].t), y(null));
  ctx.closePath();
  ctx.fillStyle = fill;
  ctx.fill();
}

function drawAxes(ctx, box, maxTokens, maxRequests, color) {
  const { left, right, top, bottom, w, h } = box;
  ctx.font = "11px system-ui, sans-serif";
  ctx.lineWidth = 1;
  for (let i = 0; i <= 4; i += 1) {
    const y = top + ((h - top - bottom) * i) / 4;
    ctx.strokeStyle = color("--grid");
    ctx.beginPath(); ctx.moveTo(left, y); ctx.lineTo(w - right, y); ctx.stroke();
    ctx.fillStyle = color("--tokens");
    ctx.textAlign = "right";
    ctx.fillText(axisLabel((maxTokens * (4 - i)) / 4), left - 6, y + 4);
    ctx.fillStyle = color("--requests");
    ctx.textAlign = "left";
    ctx.fillText(axisLabel((maxRequests * (4 - i)) / 4), w - right + 6, y + 4);
  }
}

// points: [{t (seconds since the epoch), tps, rps}], oldest first.
export function drawChart(canvas, points, windowSeconds) {
  const { clientWidth: w, clientHeight: h } = canvas.parentElement;
  const dpr = window.devicePixelRatio || 1;
  canvas.width = Math.round(w * dpr);
  canvas.height = Math.round(h * dpr);
  const ctx = canvas.getContext("2d");
  ctx.setTransform(dpr, 0, 0, dpr, 0, 0);
  ctx.clearRect(0, 0, w, h);
  const css = getComputedStyle(document.documentElement);
  const color = (name) => css.getPropertyValue(name).trim();
  const box = { left: 48, right: 48, top: 12, bottom: 26, w, h };
  const plotW = w - box.left - box.right;
  const plotH = h - box.top - box.bottom;
  const now = Date.now() / 1000;
  const maxTokens = niceMax(Math.max(0, ...points.map((p) => p.tps)));
  const maxRequests = niceMax(Math.max(0, ...points.map((p) => p.rps)));
  const x = (t) => box.left + (1 - (now - t) / windowSeconds) * plotW;
  const y = (key, max) => (p) => box.top + plotH * (1 - (p ? p[key] : 0) / max);

  drawAxes(ctx, box, maxTokens, maxRequests, color);
  ctx.fillStyle = color("--muted");
  ctx.textAlign = "center";
  for (let m = Math.floor(windowSeconds / 60); m >= 0; m -= 1) {
    ctx.fillText(m ? `−${m} min` : "now", x(now - m * 60), h - 8);
  }
  ctx.save();
  ctx.beginPath(); ctx.rect(box.left, box.top, plotW, plotH); ctx.clip();
  drawSeries(ctx, points, x, y("tps", maxTokens), color("--tokens"), color("--tokens-fill"));
  drawSeries(ctx, points, x, y("rps", maxRequests), color("--requests"), null);
  ctx.restore();
}
