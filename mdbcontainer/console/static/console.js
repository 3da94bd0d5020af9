// The console's one script, served by the console itself (no network needed).
// It does two things: it redraws the parts of a page marked data-refresh from
// their URL (the Ports table, every second), and it asks before a form marked
// data-confirm is sent (Purge). Every action stays an ordinary form POST that
// carries its CSRF token, so the page works the same when this script fails.
(function () {
  "use strict";

  function redraw(element) {
    fetch(element.getAttribute("data-refresh"), {credentials: "same-origin", cache: "no-store"})
      .then(function (response) {
        if (response.status === 401) { window.location.reload(); return null; }
        element.toggleAttribute("data-stale", !response.ok);
        return response.ok ? response.text() : null;
      })
      .then(function (html) {
        if (html !== null && html !== undefined) { element.innerHTML = html; }
      })
      .catch(function () { element.setAttribute("data-stale", ""); });
  }

  function start() {
    // A note of what an action did fades after a while: the page keeps changing under it.
    document.querySelectorAll(".flash").forEach(function (note) {
      window.setTimeout(function () { note.hidden = true; }, 10000);
    });
    document.querySelectorAll("[data-refresh]").forEach(function (element) {
      var every = parseInt(element.getAttribute("data-every") || "1000", 10);
      window.setInterval(function () { redraw(element); }, every);
    });
  }

  document.addEventListener("submit", function (event) {
    var form = event.target;
    var question = form.getAttribute("data-confirm");
    if (!question) { return; }
    if (!window.confirm(question)) { event.preventDefault(); return; }
    var confirmed = form.querySelector("input[name=confirmed]");
    if (confirmed) { confirmed.value = "yes"; }
  });

  if (document.readyState === "loading") {
    document.addEventListener("DOMContentLoaded", start);
  } else {
    start();
  }
})();
