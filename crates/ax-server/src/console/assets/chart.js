// ax console charts: small SVG line charts drawn from the series the server keeps
// (no charting library, no build step).
"use strict";

const CHART_COLORS = ["#2f5bea", "#12b76a", "#f79009", "#d92d20", "#7a5af8", "#667085"];

// chart({ id, title, unit, series: [{ name, points: [[t_ms, value|null], ...] }] })
// answers an <svg> string: a line per series over the points' time range, the largest
// value on the y axis, the times at both ends, a legend, and a <title> on every point
// (its time and value) for hovering.
function chart({ id, title, unit = "", series, width = 560, height = 180 }) {
  const L = 48, R = 10, T = 26, B = 38;
  const all = series.flatMap((s) => s.points).filter((p) => p[1] !== null && p[1] !== undefined);
  const ts = series.flatMap((s) => s.points.map((p) => p[0]));
  const t0 = Math.min(...ts), t1 = Math.max(...ts);
  const top = Math.max(1, ...all.map((p) => p[1]));
  const x = (t) => L + (t1 > t0 ? ((t - t0) / (t1 - t0)) * (width - L - R) : 0);
  const y = (v) => T + (1 - v / top) * (height - T - B);
  const fmt = (v) => (v >= 100 ? Math.round(v) : Math.round(v * 10) / 10).toLocaleString();
  const time = (t) => new Date(t).toLocaleTimeString([], { hour: "2-digit", minute: "2-digit" });
  const lines = series.map((s, i) => {
    const color = CHART_COLORS[i % CHART_COLORS.length];
    const pts = s.points.filter((p) => p[1] !== null && p[1] !== undefined);
    const path = pts.map((p, j) => `${j ? "L" : "M"}${x(p[0]).toFixed(1)},${y(p[1]).toFixed(1)}`).join("");
    const dots = pts.filter((p) => p[1] > 0).map((p) =>
      `<circle cx="${x(p[0]).toFixed(1)}" cy="${y(p[1]).toFixed(1)}" r="2.5" fill="${color}"><title>${esc(s.name)} ${time(p[0])}: ${fmt(p[1])}${unit}</title></circle>`).join("");
    return `<path d="${path}" fill="none" stroke="${color}" stroke-width="1.6" data-series="${esc(s.name)}"/>${dots}`;
  }).join("");
  const legend = series.map((s, i) =>
    `<tspan fill="${CHART_COLORS[i % CHART_COLORS.length]}">■</tspan> ${esc(s.name)}  `).join("");
  const empty = all.every((p) => !p[1]) ? `<text x="${width / 2}" y="${height / 2}" text-anchor="middle" class="muted-svg">nothing in this hour</text>` : "";
  return `<svg class="chart" id="${esc(id)}" width="${width}" height="${height}" role="img" aria-label="${esc(title)}">
    <text x="${L}" y="16" class="chart-title">${esc(title)}</text>
    <line x1="${L}" y1="${y(0)}" x2="${width - R}" y2="${y(0)}" stroke="#d0d5dd"/>
    <line x1="${L}" y1="${T}" x2="${width - R}" y2="${T}" stroke="#f2f4f7"/>
    <text x="${L - 6}" y="${T + 4}" text-anchor="end">${fmt(top)}${unit}</text>
    <text x="${L - 6}" y="${y(0) + 4}" text-anchor="end">0</text>
    ${ts.length ? `<text x="${L}" y="${height - B + 16}">${time(t0)}</text><text x="${width - R}" y="${height - B + 16}" text-anchor="end">${time(t1)}</text>` : ""}
    ${lines}${empty}
    <text x="${L}" y="${height - 6}">${legend}</text></svg>`;
}
