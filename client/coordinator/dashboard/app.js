// The coordinator's dashboard: the fleet now, the checkpoint history, a chart of durations by
// stage and sizes, one checkpoint's detail, the restores. It reads the coordinator's JSON API
// with the bearer token and polls it (every POLL_MS, paused while the tab is hidden).
//
// Why polling and not server-sent events: an EventSource cannot send an Authorization header,
// so the token would have to travel in the URL (where proxies and access logs keep it) or in a
// cookie (which any page of the origin would then send); a poll is two small GETs every two
// seconds, of routes that exist anyway.
//
// Every value from the API is put into the page with textContent, never as markup: checkpoint
// ids, member names and failure messages come from the fleet and the checkpoint root, and a
// message is whatever text a member's error carried.
"use strict";

(() => {
  const POLL_MS = 2000;
  const PAGE_SIZE = 100;
  const CHART_HEIGHT = 220;
  const TOKEN_KEY = "rollout-checkpoint.token";
  const STAGES = ["prepare", "scope", "commit", "snapshot", "publish", "resume", "durable", "retention"];
  const STAGE_COLORS = {
    prepare: "#4c78a8", scope: "#9d755d", commit: "#f58518", snapshot: "#e45756",
    publish: "#54a24b", resume: "#72b7b2", durable: "#b279a2", retention: "#bab0ac",
  };

  let token = null;
  let timer = null;
  let polling = false;
  let chart = null;
  let chartKey = "";
  let chartOwn = [];
  let selected = null;

  const byId = (id) => document.getElementById(id);

  class TokenRefused extends Error {}

  // -- the token -------------------------------------------------------------------------

  // A token passed as `#token=...` is taken once and removed from the address bar: the
  // fragment never reaches the server, but it stays in the tab's history and screenshots.
  function takeToken() {
    const fragment = new URLSearchParams(window.location.hash.slice(1));
    const passed = fragment.get("token");
    if (passed) {
      sessionStorage.setItem(TOKEN_KEY, passed);
      window.history.replaceState(null, "", window.location.pathname + window.location.search);
    }
    return sessionStorage.getItem(TOKEN_KEY);
  }

  function askForToken(problem) {
    stopPolling();
    token = null;
    sessionStorage.removeItem(TOKEN_KEY);
    byId("dashboard").hidden = true;
    byId("forget-token").hidden = true;
    byId("token-form").hidden = false;
    byId("token-problem").textContent = problem || "";
    setState("a token is needed to read the coordinator");
    byId("token-input").focus();
  }

  function useToken(value) {
    token = value;
    byId("token-form").hidden = true;
    byId("forget-token").hidden = false;
    byId("dashboard").hidden = false;
    setState("loading…");
    poll();
  }

  // -- the API ---------------------------------------------------------------------------

  async function api(path) {
    const response = await fetch(path, {
      headers: { Authorization: `Bearer ${token}`, Accept: "application/json" },
      cache: "no-store",
      credentials: "omit",
    });
    if (response.status === 401 || response.status === 403) {
      throw new TokenRefused(`${path}: HTTP ${response.status}`);
    }
    if (!response.ok) {
      throw new Error(`${path}: HTTP ${response.status}`);
    }
    return response.json();
  }

  // proto3's JSON mapping leaves out every field at its default (0, "", false), writes a
  // 64-bit integer as a string and an enum as its name.
  function seconds(value) {
    return typeof value === "number" && Number.isFinite(value) ? value : 0;
  }

  function count(value) {
    const number = typeof value === "string" ? parseInt(value, 10) : value;
    return Number.isFinite(number) ? number : 0;
  }

  function epoch(timestamp) {
    const parsed = Date.parse(timestamp || "");
    return Number.isNaN(parsed) ? null : parsed / 1000;
  }

  // -- polling ---------------------------------------------------------------------------

  function stopPolling() {
    clearTimeout(timer);
    timer = null;
  }

  function schedule() {
    stopPolling();
    if (token !== null && !document.hidden) timer = setTimeout(poll, POLL_MS);
  }

  async function poll() {
    if (polling || token === null) return;
    polling = true;
    try {
      const problem = await refresh();
      if (problem) setState(`history skipped: ${problem}`, true);
      else setState(`updated ${new Date().toLocaleTimeString()} · every ${POLL_MS / 1000} s`);
    } catch (error) {
      if (error instanceof TokenRefused) {
        polling = false;
        askForToken("The coordinator refused this token.");
        return;
      }
      setState(`cannot reach the coordinator: ${error.message}`, true);
    }
    polling = false;
    schedule();
  }

  // `ATTEMPT_STATUS_COMPLETED` -> `completed`: what the CLI's `history` prints too.
  function enumName(value, prefix) {
    return String(value || "").replace(prefix, "").toLowerCase();
  }

  function attempt(message) {
    return {
      ...message,
      operation: enumName(message.operation, "ATTEMPT_OPERATION_"),
      status: enumName(message.status, "ATTEMPT_STATUS_"),
    };
  }

  async function refresh() {
    const [fleet, listed] = await Promise.all([
      api("/fleet/status"),
      api(`/checkpoints?page_size=${PAGE_SIZE}`),
    ]);
    const entries = (listed.checkpoints || []).map(attempt);
    renderFleet(fleet.members || []);
    byId("fleet-stale").hidden = !fleet.stale;
    renderCounts(entries, listed);
    renderHistory(entries);
    renderChart(entries.filter((e) => e.operation === "checkpoint"));
    renderRestores(entries.filter((e) => e.operation === "restore"));
    if (selected !== null) await showDetail(selected);
    return listed.historyProblem || "";
  }

  function setState(text, problem) {
    const state = byId("state");
    state.textContent = text;
    state.classList.toggle("problem", Boolean(problem));
  }

  // -- building the page (text only) -----------------------------------------------------

  function cell(text, className) {
    const td = document.createElement("td");
    td.textContent = text === undefined || text === null ? "" : String(text);
    if (className) td.className = className;
    return td;
  }

  function fillBody(table, rows, columns) {
    const body = byId(table).tBodies[0];
    body.replaceChildren(...rows);
    if (!rows.length) {
      const empty = cell("nothing yet", "empty");
      empty.colSpan = columns;
      const tr = document.createElement("tr");
      tr.append(empty);
      body.append(tr);
    }
  }

  function fillList(list, pairs) {
    const items = [];
    for (const [term, value] of pairs) {
      const wrap = document.createElement("div");
      const dt = document.createElement("dt");
      const dd = document.createElement("dd");
      dt.textContent = term;
      dd.textContent = String(value);
      wrap.append(dt, dd);
      items.push(wrap);
    }
    list.replaceChildren(...items);
  }

  function humanBytes(value) {
    let size = count(value);
    for (const unit of ["B", "KiB", "MiB", "GiB"]) {
      if (size < 1024 || unit === "GiB") return unit === "B" ? `${size} B` : `${size.toFixed(1)} ${unit}`;
      size /= 1024;
    }
    return `${size} B`;
  }

  function shortTime(timestamp) {
    return (timestamp || "").slice(0, 19).replace("T", " ");
  }

  function reasonText(entry) {
    if (!entry.reason) return "";
    const members = entry.failedMembers || [];
    return members.length ? `${entry.reason} (${members.join(", ")})` : entry.reason;
  }

  function statusClass(value) {
    return `status-${String(value).replace(/[^a-z_]/g, "")}`;
  }

  // A member that answered has a state and a readiness; one that did not, the reason.
  function readinessText(member) {
    if (member.health !== "serving") return member.error || "";
    if (member.ready) return "ready";
    return `not ready: ${count(member.blockers)} blocker(s)`;
  }

  function renderFleet(members) {
    const rows = members.map((member) => {
      const tr = document.createElement("tr");
      const health = String(member.health || "unknown");
      tr.dataset.member = member.name;
      tr.append(
        cell(member.name),
        cell(member.kind),
        cell(member.address),
        cell(health, `health health-${health.replace(/[^a-z_]/g, "")}`),
        cell(readinessText(member), "readiness"),
        cell(member.state ? `${member.state}, admission ${member.admission}` : ""),
      );
      return tr;
    });
    fillBody("fleet", rows, 6);
  }

  // The counts cover the whole history; the tables show its newest PAGE_SIZE attempts.
  function renderCounts(entries, listed) {
    const counts = listed.counts || {};
    const latest = entries.find((e) => e.operation === "checkpoint" && e.status === "completed");
    const pairs = [
      ["completed", count(counts.completed)],
      ["failed", count(counts.failed)],
      ["aborted", count(counts.aborted)],
      ["restores", count(counts.restores)],
      ["latest completed", latest ? latest.id : "none"],
      ["shown", `newest ${entries.length} of ${count(listed.totalSize)}`],
    ];
    fillList(byId("counts"), pairs);
  }

  // The list is newest first, like the table.
  function renderHistory(entries) {
    const rows = entries.map((entry) => {
      const tr = document.createElement("tr");
      tr.dataset.id = entry.id;
      tr.classList.toggle("selected", entry.id === selected);
      tr.append(
        cell(entry.id, "id"),
        cell(entry.operation),
        cell(entry.trigger),
        cell(entry.mode),
        cell(entry.status, `status ${statusClass(entry.status)}`),
        cell(shortTime(entry.startedAt)),
        cell(`${seconds(entry.durationSeconds).toFixed(2)} s`, "number"),
        cell(count(entry.members), "number"),
        cell(count(entry.records), "number"),
        cell(entry.operation === "checkpoint" ? humanBytes(entry.bytes) : "-", "number"),
        cell(reasonText(entry), "reason"),
      );
      tr.addEventListener("click", () => select(entry.id));
      return tr;
    });
    fillBody("history", rows, 11);
  }

  function renderRestores(restores) {
    const rows = restores.map((entry) => {
      const tr = document.createElement("tr");
      tr.append(
        cell(entry.id),
        cell(entry.source),
        cell(entry.mode),
        cell(entry.trigger),
        cell(entry.status, statusClass(entry.status)),
        cell(shortTime(entry.startedAt)),
        cell(`${seconds(entry.durationSeconds).toFixed(2)} s`, "number"),
        cell(count(entry.continued), "number"),
        cell(count(entry.restarted), "number"),
        cell(reasonText(entry), "reason"),
      );
      return tr;
    });
    fillBody("restores", rows, 10);
  }

  // -- one checkpoint --------------------------------------------------------------------

  async function select(id) {
    selected = id;
    for (const tr of byId("history").tBodies[0].rows) {
      tr.classList.toggle("selected", tr.dataset.id === id);
    }
    try {
      await showDetail(id);
    } catch (error) {
      if (error instanceof TokenRefused) askForToken("The coordinator refused this token.");
      else setState(`cannot read ${id}: ${error.message}`, true);
    }
  }

  async function showDetail(id) {
    const found = await api(`/checkpoints/${encodeURIComponent(id)}`);
    const entry = attempt(found.checkpoint || {});
    byId("detail").hidden = false;
    byId("detail-id").textContent = entry.id;
    byId("detail-operation").textContent = entry.operation;
    const pairs = [
      ["status", entry.status],
      ["trigger, mode", `${entry.trigger}, ${entry.mode}`],
      ["started", entry.startedAt],
      ["ended", entry.endedAt],
      ["duration", `${seconds(entry.durationSeconds).toFixed(3)} s`],
      ["members", count(entry.members)],
      ["records", count(entry.records)],
      ["bytes", humanBytes(entry.bytes)],
    ];
    if (entry.operation === "restore") {
      pairs.push(["source", entry.source], ["continued", count(entry.continued)],
        ["restarted", count(entry.restarted)]);
    }
    if (entry.reason) {
      pairs.push(["reason", entry.reason], ["message", entry.message],
        ["failed members", (entry.failedMembers || []).join(", ")]);
    }
    if (found.detailsDropped) pairs.push(["members' details", "dropped (older than the newest 100)"]);
    if (found.detailsProblem) pairs.push(["members' details", found.detailsProblem]);
    fillList(byId("detail-summary"), pairs);
    fillBody("detail-stages", (entry.stages || []).map((stage) => {
      const tr = document.createElement("tr");
      tr.append(cell(stage.stage), cell(seconds(stage.seconds).toFixed(3), "number"));
      return tr;
    }), 2);
    fillBody("detail-members", (found.members || []).map(memberRow), 12);
  }

  // An optional field left out means "never": the member never prepared, never replied.
  function stageSeconds(value) {
    return typeof value === "number" ? `${value.toFixed(3)} s` : "never";
  }

  function memberRow(member) {
    const tr = document.createElement("tr");
    tr.append(
      cell(member.name),
      cell(enumName(member.kind, "PARTICIPANT_KIND_")),
      cell(stageSeconds(member.preparedSeconds), "number"),
      cell(member.commitSeconds === undefined ? "" : stageSeconds(member.commitSeconds), "number"),
      cell(member.durableSeconds === undefined ? "" : stageSeconds(member.durableSeconds), "number"),
      cell(member.restoreSeconds === undefined ? "" : stageSeconds(member.restoreSeconds), "number"),
      cell(count(member.blockersMax), "number"),
      cell(`${seconds(member.blockedSeconds).toFixed(3)} s`, "number"),
      cell(count(member.records), "number"),
      cell(humanBytes(member.bytes), "number"),
      cell(member.error || "", member.error ? "status-failed" : ""),
      cell(member.part || "", "part"),
    );
    return tr;
  }

  // -- the chart -------------------------------------------------------------------------

  // Every stage the attempts name, in the order a checkpoint runs them (a stage this page
  // does not know goes last rather than missing from the chart).
  function stagesOf(points) {
    const named = new Set(points.flatMap((p) => (p.entry.stages || []).map((s) => s.stage)));
    return [...STAGES.filter((s) => named.has(s)), ...[...named].filter((s) => !STAGES.includes(s))];
  }

  // Stacked bars: uPlot draws series in order, so each stage is a bar from 0 to the sum of
  // the stages up to it, the longest first; each shorter one paints over the one before and
  // what shows of each is its own stage. The legend shows the stage's own seconds.
  function chartData(checkpoints) {
    const points = checkpoints
      .map((entry) => ({ at: epoch(entry.startedAt), entry }))
      .filter((point) => point.at !== null)
      .sort((a, b) => a.at - b.at);
    const present = stagesOf(points);
    const own = present.map((stage) => points.map((p) => {
      const found = (p.entry.stages || []).find((s) => s.stage === stage);
      return found ? seconds(found.seconds) : 0;
    }));
    const stacked = own.map((_, index) => points.map((__, column) =>
      own.slice(0, index + 1).reduce((sum, row) => sum + row[column], 0)));
    return {
      present,
      own,
      data: [
        points.map((p) => p.at),
        ...stacked.reverse(),
        points.map((p) => count(p.entry.bytes)),
      ],
    };
  }

  function chartWidth() {
    return Math.max(320, byId("chart").clientWidth);
  }

  function renderChart(checkpoints) {
    const { present, own, data } = chartData(checkpoints);
    const key = present.join(",");
    if (chart !== null && key === chartKey) {
      chartOwn.splice(0, chartOwn.length, ...[...own].reverse());
      chart.setData(data);
      return;
    }
    if (chart !== null) chart.destroy();
    chartKey = key;
    chartOwn = [...own].reverse();
    chart = new uPlot(chartOptions([...present].reverse()), data, byId("chart"));
  }

  function chartOptions(stages) {
    const bars = uPlot.paths.bars({ size: [0.6, 40] });
    const stageSeries = stages.map((stage, index) => ({
      label: stage,
      scale: "s",
      fill: STAGE_COLORS[stage] || "#888",
      stroke: STAGE_COLORS[stage] || "#888",
      paths: bars,
      points: { show: false },
      value: (u, value, series, row) =>
        (row === null || row === undefined ? "" : `${chartOwn[index][row].toFixed(3)} s`),
    }));
    const bytes = {
      label: "bytes",
      scale: "bytes",
      stroke: "#222",
      paths: () => null,
      points: { show: true, size: 7, fill: "#222" },
      value: (u, value) => (value === null ? "" : humanBytes(value)),
    };
    return {
      width: chartWidth(),
      height: CHART_HEIGHT,
      series: [{}, ...stageSeries, bytes],
      axes: [
        {},
        { scale: "s", label: "seconds", size: 60, values: (u, ticks) => ticks.map((t) => `${t} s`) },
        { scale: "bytes", side: 1, label: "bytes", size: 80, grid: { show: false },
          values: (u, ticks) => ticks.map((t) => humanBytes(t)) },
      ],
      scales: {
        // Room on both sides, so the first and the last bar show whole.
        x: { range: (u, min, max) => {
          const pad = Math.max(5, (max - min) * 0.04);
          return [min - pad, max + pad];
        } },
        s: { range: (u, min, max) => [0, max > 0 ? max * 1.1 : 1] },
        bytes: { range: (u, min, max) => [0, max > 0 ? max * 1.1 : 1] },
      },
    };
  }

  window.addEventListener("resize", () => {
    if (chart !== null) chart.setSize({ width: chartWidth(), height: CHART_HEIGHT });
  });

  // -- start -----------------------------------------------------------------------------

  document.addEventListener("visibilitychange", () => {
    if (document.hidden) stopPolling();
    else poll();
  });

  byId("token-form").addEventListener("submit", (event) => {
    event.preventDefault();
    const value = byId("token-input").value.trim();
    if (!value) return;
    sessionStorage.setItem(TOKEN_KEY, value);
    byId("token-input").value = "";
    useToken(value);
  });

  byId("forget-token").addEventListener("click", () => askForToken(""));

  const found = takeToken();
  if (found) useToken(found);
  else askForToken("");
})();
