"""``accelrun plan``: predict a recipe's memory, step time and MFU on a cluster, search its layouts.

Torch-free (``accelrun.plan.calibrate`` imports torch when it measures). The flow:

    load_plan_config   recipe + --cluster + overrides → validated RunConfig   (loading.py)
    resolve_cluster    cluster section → device rates and links              (cluster.py, accelerators.py)
    workload_from_config  shapes, layout, batch, options                       (workload.py)
    estimate_memory    per-device peak, term by term                         (memory.py, activations.py)
    estimate_time      per-step time, part by part                           (timing.py, traffic.py, comm.py,
                                                                               pipeline.py, efficiency.py)
    predict            all of the above, with throughput, MFU and a verdict  (predict.py)
    search_layouts     every valid layout on the cluster, best first         (search.py)
"""

from accelrun.plan.cluster import Cluster, resolve_cluster
from accelrun.plan.errors import PlanError
from accelrun.plan.loading import PlanInput, load_plan_config
from accelrun.plan.predict import Plan, predict
from accelrun.plan.search import SearchResult, search_layouts
from accelrun.plan.workload import PlanOptions

__all__ = ["Cluster", "Plan", "PlanError", "PlanInput", "PlanOptions", "SearchResult", "load_plan_config",
           "predict", "resolve_cluster", "search_layouts"]
