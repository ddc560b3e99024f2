// Auto-refresh of a run that is not finished: every 2 s, fetch this page again
// and swap its <article id="run">. Stops once the run has finished (the fresh
// page no longer asks for it), or when the tab is hidden (resumes when shown).
(function () {
  "use strict";
  var period = parseInt(document.body.dataset.refresh || "0", 10);
  if (!period) { return; }
  var timer = null;

  function schedule() {
    if (timer === null && document.visibilityState === "visible") {
      timer = window.setTimeout(refresh, period);
    }
  }

  function refresh() {
    timer = null;
    fetch(window.location.href, { credentials: "same-origin", cache: "no-store",
                                  headers: { "Accept": "text/html" }, redirect: "manual" })
      .then(function (response) {
        if (!response.ok) { throw new Error("status " + response.status); }
        return response.text();
      })
      .then(function (html) {
        var fresh = new DOMParser().parseFromString(html, "text/html");
        var next = fresh.getElementById("run");
        var current = document.getElementById("run");
        if (!next || !current) { return; }
        // Keep open <details> open across the swap.
        var open = Array.prototype.map.call(current.querySelectorAll("details[open]"),
                                            function (d) { return d.textContent.slice(0, 80); });
        current.replaceWith(next);
        next.querySelectorAll("details").forEach(function (d) {
          if (open.indexOf(d.textContent.slice(0, 80)) >= 0) { d.open = true; }
        });
        document.body.dataset.refreshed = String(Date.now());
        period = parseInt(fresh.body.dataset.refresh || "0", 10);
        if (!period) { delete document.body.dataset.refresh; return; }
        schedule();
      })
      .catch(function () { schedule(); });  // a restart of web, a blip: try again
  }

  document.addEventListener("visibilitychange", schedule);
  schedule();
}());
