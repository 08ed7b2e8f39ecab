import sys,torch
sys.path[:0]=[".","../perf/results/s31","../perf"]
import test_mma_recipe as T
from kvbackend.batch import PACKED
from kvbackend.kernels import mma_decode as M
G=torch.cuda.is_available()
if G:
 import ab_decode as A
 from kvbackend.kernels.paged_decode import paged_decode as pd
S={'new':'../kernels/mma_decode.cu','base':'../perf/results/s31/mma_decode_base.cu'}
Q="quantwm:kchannel=%d,rank=4,keep=%s,centroids=%d,clip=true,vcluster=false,sink=4,vrot=hadamard,prerope=true,cdtype=fp8,outliers=16"
C=[(T.PREROPE_CASES[3][0],64),(Q%(64,'0.25',32),64),(Q%(128,'0.125',32),128),(Q%(32,'0.25',4),32),(T.PREROPE_CASES[6][0],64),("kivi:bits=2,group=64,scale=bf16,prerope=true",64),(T.PREROPE_CASES[5][0],32)]
for codec,P in C:
 cache,ids,rot=T.recipe_cache(codec,128,P,2,[700,150],2,4,seed=3)
 args,lv=T._inputs(cache,ids)
 cfg=M.config_for(*args[3],P,128,torch.bfloat16,torch.bfloat16,2,4,None,lv)
 q=torch.randn(len(ids),8,128,device=args[0].device).bfloat16()
 pages,plan=args[0],args[4]
 used=sorted({int(p) for p,k in zip(plan.page_ids.tolist(),plan.kinds.tolist()) if k==PACKED})
 bad=pages.clone();F=cache.layouts[0].page.fields
 if 'k_psac_token' in F:
  f=F['k_psac_token'];n,H=f.shape[-2:]
  for p in used:
   v=bad[p,f.offset:f.offset+n*H].view(n,H);v[1]=v[0];v[-1,1]=255
 if 'k_assign' in F:
  f=F['k_assign'];_,PP,H=f.shape;c=cache.layouts[0].codebook.fields['k_centroids'].shape[2]
  for p in used[::2]:
   v=bad[p,f.offset:f.offset+PP*H].view(PP,H);v[::3,0]=c;v[1::3,1]=255
 print(codec[:50],P,'rows',cfg.psac_rows,'fold',cfg.psac_fold,'kk',cfg.k_kind,'kb',cfg.k_bits,'cent',cfg.centroids,'smem',cfg.smem_bytes,'changed',int((bad!=pages).sum()),flush=True)
 if not G: continue
 o={}
 for s in S:
  A.use(s,S[s])
  for nm,pg in (('ok',pages),('bad',bad)):
   o[s,nm]=pd(q,pg,*args[1:],target_programs=16,levers=lv,rotary=rot,mma=True,mma_options=T.OPT_IN)[0].float()
 for nm in ('ok','bad'):
  a,b=o['new',nm],o['base',nm]
  print(' ',nm,'equal',torch.equal(a,b),'maxdiff',float((a-b).abs().max()),'finite',bool(torch.isfinite(a).all()),flush=True)
 print('  bad vs ok',float((o['new','bad']-o['new','ok']).norm()/o['new','ok'].norm()))
