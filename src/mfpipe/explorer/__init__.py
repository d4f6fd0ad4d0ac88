"""The interactive explorer (issue 61): a static, self-contained site per model, written from the tables and stores a
run already has, that opens from disk with no server and no network.

* :mod:`mfpipe.explorer.scores` -- the per-head scores of a model (one ``[layer, head]`` grid per score and revision)
  and the heads' role labels, each read from the table or store it comes from, with that source named.
* :mod:`mfpipe.explorer.cards` -- one head card per head and revision: its rows in every table that has it, its
  kernel W restricted to the top query and key types (P, n̄, C beside it), its top-deviation contexts with the head's
  attention over each and their decodes (from the lenses' table).
* :mod:`mfpipe.explorer.pages` -- the run's pages: the rollout by depth, the substitution across training, the
  function vectors, the divergence diagnostics, from the same tables as the run's figures; and the tables the cards
  link to, as HTML with one anchor per head row.
* :mod:`mfpipe.explorer.site` -- writing it: the model page, the data files a page loads on demand (script files that
  register themselves, so that a page opened from ``file://`` can load them) and the index over the models.
* :mod:`mfpipe.explorer.assets` -- the shared assets: plotly's bundle and the explorer's script and style
  (``static/``).
* :mod:`mfpipe.explorer.rules` -- the explorer's targets and the inputs of its rules, on the run's plan.
* :mod:`mfpipe.explorer.jobs` -- the job functions of rules ``explorer_assets``, ``explorer`` and ``explorer_index``.

Plotly draws the charts: its Python package carries the whole plotly.js bundle as one file, which the site ships once
beside its pages, so nothing comes from a CDN; its heatmaps have the hover and click events the head grid needs. Every
piece of corpus text reaches the page as data inside JSON and is put into the page as text (``textContent``, plotly
labels HTML-escaped), never as markup.
"""
