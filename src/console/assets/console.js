// outbox-gateway console: progressive enhancement only. The pages work without this
// script; with it, figures refresh every few seconds, times show in the browser's zone
// with how long ago, time fields know the browser's offset from UTC, and a checkbox
// selects every dead letter on the page.
"use strict";

(function () {
  const REFRESH_MS = 5000;

  function relative(date) {
    const seconds = Math.round((Date.now() - date.getTime()) / 1000);
    const future = seconds < 0;
    const s = Math.abs(seconds);
    let text;
    if (s < 5) return "just now";
    if (s < 60) text = s + " s";
    else if (s < 3600) text = Math.floor(s / 60) + " min";
    else if (s < 86400) text = Math.floor(s / 3600) + " h";
    else text = Math.floor(s / 86400) + " d";
    return future ? "in " + text : text + " ago";
  }

  function showTimes(root) {
    root.querySelectorAll("time[data-relative]").forEach(function (element) {
      const date = new Date(element.getAttribute("datetime"));
      if (isNaN(date.getTime())) return;
      if (!element.title) element.title = element.textContent.trim();
      const today = date.toDateString() === new Date().toDateString();
      const shown = today
        ? date.toLocaleTimeString(undefined, { hour: "2-digit", minute: "2-digit", second: "2-digit" })
        : date.toLocaleString(undefined, {
            year: "numeric", month: "short", day: "numeric", hour: "2-digit", minute: "2-digit"
          });
      element.textContent = shown;
      // The stylesheet shows how long ago after the time.
      element.setAttribute("data-ago", relative(date));
    });
  }

  function setTimezones(root) {
    const offset = String(-new Date().getTimezoneOffset());
    root.querySelectorAll("input[data-timezone]").forEach(function (input) {
      // A filter already applied keeps the zone it was written in.
      if (input.value === "0" || input.value === "") input.value = offset;
    });
  }

  function enableSelectAll(root) {
    root.querySelectorAll("input[data-select-all]").forEach(function (all) {
      const name = all.getAttribute("data-select-all");
      const form = all.form;
      all.hidden = false;
      all.addEventListener("change", function () {
        form.querySelectorAll('input[type=checkbox][name="' + name + '"]').forEach(function (box) {
          box.checked = all.checked;
        });
      });
    });
  }

  let refreshing = false;
  async function refresh() {
    const regions = document.querySelectorAll("[data-refresh][id]");
    if (refreshing || regions.length === 0 || document.visibilityState !== "visible") return;
    refreshing = true;
    try {
      const response = await fetch(window.location.href, {
        credentials: "same-origin",
        headers: { "Accept": "text/html" }
      });
      const url = new URL(response.url);
      if (url.pathname !== window.location.pathname) {
        // Sent to sign in: the session has ended.
        window.location.reload();
        return;
      }
      if (!response.ok) {
        // A 503 page: the database is unreachable. Say so over the figures shown.
        document.body.setAttribute("data-stale", "");
        return;
      }
      document.body.removeAttribute("data-stale");
      const page = new DOMParser().parseFromString(await response.text(), "text/html");
      regions.forEach(function (region) {
        const fresh = page.getElementById(region.id);
        if (!fresh) return;
        if (region.contains(document.activeElement) && document.activeElement !== document.body) return;
        region.replaceWith(fresh);
        showTimes(fresh);
      });
    } catch (error) {
      // The gateway may be restarting; the next round tries again.
      document.body.setAttribute("data-stale", "");
    } finally {
      refreshing = false;
    }
  }

  document.addEventListener("DOMContentLoaded", function () {
    showTimes(document);
    setTimezones(document);
    enableSelectAll(document);
    setInterval(refresh, REFRESH_MS);
    setInterval(function () { showTimes(document); }, 30000);
  });
})();
