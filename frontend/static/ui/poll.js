// Live regions without a framework. An element with data-poll="URL" has its content replaced by
// what URL returns (a server-rendered partial) every data-poll-every ms (default 1000). The server
// ends the polling with the response header "X-Strata-Poll: stop" (e.g. a job reached a final
// state). Network errors and 5xx answers are retried with backoff; a 4xx answer stops; an answer
// that was redirected (the session expired, so the login page came back) reloads the page.
(function () {
  "use strict";

  function poll(el, delay) {
    var every = parseInt(el.getAttribute("data-poll-every") || "1000", 10);
    var last = null; // the last partial swapped in, as received

    function later(ms) {
      window.setTimeout(tick, ms);
    }

    function tick() {
      var url = el.getAttribute("data-poll");
      if (!url || !document.body.contains(el)) {
        return;
      }
      fetch(url, {
        credentials: "same-origin",
        cache: "no-store",
        headers: { "X-Requested-With": "strata-poll" },
      })
        .then(function (response) {
          if (response.redirected) {
            window.location.reload();
            return;
          }
          if (response.status >= 400 && response.status < 500) {
            el.removeAttribute("data-poll");
            return;
          }
          if (!response.ok) {
            throw new Error("HTTP " + response.status);
          }
          var stop = response.headers.get("X-Strata-Poll") === "stop";
          return response.text().then(function (html) {
            if (html !== last) {
              el.innerHTML = html;
              last = html;
            }
            if (stop) {
              el.removeAttribute("data-poll");
            } else {
              delay = every;
              later(every);
            }
          });
        })
        .catch(function () {
          delay = Math.min(delay * 2, 30000);
          later(delay);
        });
    }

    later(delay);
  }

  function start() {
    var nodes = document.querySelectorAll("[data-poll]");
    for (var i = 0; i < nodes.length; i++) {
      var every = parseInt(nodes[i].getAttribute("data-poll-every") || "1000", 10);
      poll(nodes[i], every);
    }
  }

  if (document.readyState === "loading") {
    document.addEventListener("DOMContentLoaded", start);
  } else {
    start();
  }
})();
