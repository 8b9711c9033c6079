"""The planner: meet an activation-memory budget at the least step time by choosing one
lever per layer (:func:`offload.plan`, :class:`offload.Plan`).

* ``settings.py``: :class:`PlannerSettings`, the tuning, frozen, chosen once and passed in;
* ``levers.py``: the lever names and the recompute levers' wrapped forward;
* ``costs.py``: the cost model (:class:`~offload.PlanCosts`): memory and time of a plan;
* ``search.py``: the plans that fit a budget, fastest predicted first;
* ``fit.py``: the configurations measured on the user's step and the model fitted to them;
* ``verify.py``: the timed steps and the measured check of the choice;
* ``plan.py``: :class:`~offload.Plan` (apply, remove, replan) and :func:`~offload.plan`.

Nothing is re-exported here: import from the module that defines a name.
"""
