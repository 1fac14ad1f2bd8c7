/* In-app links that are not dcc.Link (markdown links in DataTables, plain anchors) navigate like
   dcc.Link: history.pushState + the event Dash's Location listens to, so the page changes without
   reloading (and re-parsing) the scripts. Modifier keys and other targets keep the browser default. */
(function () {
  var PAGES = /^\/(runs\/\d+|scaling|compare|regressions|benchmarks)?\/?$/;
  document.addEventListener('click', function (e) {
    if (e.defaultPrevented || e.button !== 0 || e.metaKey || e.ctrlKey || e.shiftKey || e.altKey) return;
    var a = e.target && e.target.closest ? e.target.closest('a[href]') : null;
    if (!a || (a.target && a.target !== '_self') || a.hasAttribute('download')) return;
    var url = new URL(a.href, window.location.href);
    if (url.origin !== window.location.origin || !PAGES.test(url.pathname)) return;
    e.preventDefault();
    window.history.pushState({}, '', url.pathname + url.search + url.hash);
    window.dispatchEvent(new CustomEvent('_dashprivate_pushstate'));
    window.scrollTo(0, 0);
  });
})();
