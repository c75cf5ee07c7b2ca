// weightsync fleet dashboard: live updates without reloading the page.
// One EventSource on /ui/events (the session cookie authenticates it) for the models this page
// shows; on a change the page fetches itself again and swaps each [data-live] region in place.
(function () {
  "use strict";
  const body = document.body;
  const status = document.getElementById("live-status");
  if (!body.hasAttribute("data-live-models") || !window.EventSource) {
    if (status) status.textContent = "";
    return;
  }
  const models = JSON.parse(body.getAttribute("data-live-models") || "[]");
  const params = new URLSearchParams();
  models.forEach(function (m) { params.append("model", m); });
  const ui = (window.weightsyncUi = { updates: 0, connected: false });
  let pending = null;
  let running = false;

  function say(text) { if (status) status.textContent = text; }

  async function refresh() {
    if (running) { schedule(); return; }
    running = true;
    try {
      const response = await fetch(window.location.href, { credentials: "same-origin", cache: "no-store" });
      if (response.status === 401) { say("Signed out: live updates stopped. Reload to sign in."); return; }
      if (!response.ok) return;
      const fresh = new DOMParser().parseFromString(await response.text(), "text/html");
      document.querySelectorAll("[data-live][id]").forEach(function (region) {
        const next = fresh.getElementById(region.id);
        if (next) region.replaceChildren.apply(region, Array.from(next.childNodes).map(function (n) { return document.importNode(n, true); }));
      });
      ui.updates += 1;
      say("Live: updated " + new Date().toLocaleTimeString());
    } catch (err) {
      say("Live updates: the server did not answer; retrying.");
    } finally {
      running = false;
    }
  }

  function schedule() {
    if (pending) return;
    pending = setTimeout(function () { pending = null; refresh(); }, 200);
  }

  const query = params.toString();
  const source = new EventSource("/ui/events" + (query ? "?" + query : ""));
  // "ready": the server has read the state it counts changes from; catch up on what changed before.
  source.addEventListener("ready", function () {
    ui.connected = true;
    body.setAttribute("data-live-state", "ready");
    say("Live: watching for new versions and replica reports");
    schedule();
  });
  source.addEventListener("change", schedule);
  source.addEventListener("error", function () {
    ui.connected = false;
    body.setAttribute("data-live-state", "reconnecting");
    say("Live updates: reconnecting…");
  });
})();
