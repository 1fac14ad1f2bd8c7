/* A "CSV" download link above every table of the pages (html tables with class fs-table: the run
   page's tables, the cluster page, regressions, compare, scaling ...). The file holds the table as
   shown: its header row and every row (these tables are not paged), cell text as displayed. Cells
   that a spreadsheet would run as a formula (=, +, @, or - not followed by a number) are prefixed
   with an apostrophe. DataTables (the fleet table) use Dash's own export button instead.
   window.fsTableCsv(table) returns the CSV text (the tests compare it with the table). */
(function () {
  function cellText(cell) {
    var t = (cell.innerText !== undefined ? cell.innerText : cell.textContent) || '';
    t = t.replace(/\s+/g, ' ').trim();
    if (/^[=+@\t\r]/.test(t) || /^-(?![\d.])/.test(t)) t = "'" + t;
    return /[",\n\r]/.test(t) ? '"' + t.replace(/"/g, '""') + '"' : t;
  }

  function tableCsv(table) {
    var lines = [];
    var rows = table.querySelectorAll('tr');
    for (var i = 0; i < rows.length; i++) {
      var cells = rows[i].querySelectorAll('th, td');
      var out = [];
      for (var j = 0; j < cells.length; j++) out.push(cellText(cells[j]));
      lines.push(out.join(','));
    }
    return lines.join('\r\n') + '\r\n';
  }

  function fileName(table, n) {
    var page = window.location.pathname.replace(/^\/+|\/+$/g, '').replace(/[^A-Za-z0-9]+/g, '-') || 'fleet';
    var name = table.id || (table.querySelector('th') ? table.querySelector('th').textContent : '') || ('table-' + n);
    name = name.trim().toLowerCase().replace(/[^a-z0-9]+/g, '-').replace(/^-+|-+$/g, '').slice(0, 40) || ('table-' + n);
    return 'fleetscope-' + page + '-' + name + '.csv';
  }

  function link(table, n) {
    var a = document.createElement('a');
    a.className = 'fs-csv-link';
    a.textContent = 'CSV';
    a.title = 'Download this table as CSV';
    a.href = '#';
    a.setAttribute('download', fileName(table, n));
    a.addEventListener('click', function () {
      // build the file when clicked: the table may have changed since the link was made
      if (a._url) URL.revokeObjectURL(a._url);
      a._url = URL.createObjectURL(new Blob([tableCsv(table)], { type: 'text/csv;charset=utf-8' }));
      a.href = a._url;
      a.setAttribute('download', fileName(table, n));
    });
    a._fsTable = table;
    return a;
  }

  function refresh() {
    // links whose table went away (a callback replaced it) go too
    var links = document.querySelectorAll('a.fs-csv-link');
    for (var i = 0; i < links.length; i++) {
      var l = links[i];
      if (!l._fsTable || !document.body.contains(l._fsTable) || l.nextSibling !== l._fsTable) l.remove();
    }
    var tables = document.querySelectorAll('table.fs-table');
    for (var k = 0; k < tables.length; k++) {
      var t = tables[k];
      var prev = t.previousSibling;
      if (prev && prev.classList && prev.classList.contains('fs-csv-link') && prev._fsTable === t) continue;
      if (!t.parentNode) continue;
      t.parentNode.insertBefore(link(t, k), t);
    }
  }

  var pending = false;
  function schedule() {
    if (pending) return;
    pending = true;
    window.requestAnimationFrame(function () { pending = false; refresh(); });
  }

  window.fsTableCsv = tableCsv;
  function start() {
    new MutationObserver(schedule).observe(document.body, { childList: true, subtree: true });
    schedule();
  }
  if (document.readyState === 'loading') document.addEventListener('DOMContentLoaded', start);
  else start();
})();
