{{/* The chart's name (nameOverride), the app.kubernetes.io/name label. */}}
{{- define "k8s-rendezvous.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" -}}
{{- end -}}

{{/* The release's prefix for every object name: fullnameOverride, else the release name
when it already contains the chart's name, else <release>-<name>. 52 characters leave
room for the longest suffix (-operator-leader-election). */}}
{{- define "k8s-rendezvous.fullname" -}}
{{- if .Values.fullnameOverride -}}
{{- .Values.fullnameOverride | trunc 52 | trimSuffix "-" -}}
{{- else -}}
{{- $name := include "k8s-rendezvous.name" . -}}
{{- if contains $name .Release.Name -}}
{{- .Release.Name | trunc 52 | trimSuffix "-" -}}
{{- else -}}
{{- printf "%s-%s" .Release.Name $name | trunc 52 | trimSuffix "-" -}}
{{- end -}}
{{- end -}}
{{- end -}}

{{/* The operator image: repository@digest when a digest is given (the tag is then only
documentation), else repository:tag (the chart's appVersion by default). */}}
{{- define "k8s-rendezvous.image" -}}
{{- if .Values.image.digest -}}
{{- printf "%s@%s" .Values.image.repository .Values.image.digest -}}
{{- else -}}
{{- printf "%s:%s" .Values.image.repository (.Values.image.tag | default .Chart.AppVersion) -}}
{{- end -}}
{{- end -}}

{{/* The operator's objects: Deployment, ServiceAccount, roles and bindings. */}}
{{- define "k8s-rendezvous.operator" -}}
{{- printf "%s-operator" (include "k8s-rendezvous.fullname" .) -}}
{{- end -}}

{{- define "k8s-rendezvous.labels" -}}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" | trunc 63 | trimSuffix "-" }}
{{ include "k8s-rendezvous.selectorLabels" . }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
app.kubernetes.io/part-of: k8s-rendezvous
{{- end -}}

{{- define "k8s-rendezvous.selectorLabels" -}}
app.kubernetes.io/name: {{ include "k8s-rendezvous.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
{{- end -}}

{{- define "k8s-rendezvous.serviceAccountName" -}}
{{- if .Values.serviceAccount.create -}}
{{- default (include "k8s-rendezvous.operator" .) .Values.serviceAccount.name -}}
{{- else -}}
{{- default "default" .Values.serviceAccount.name -}}
{{- end -}}
{{- end -}}

{{/* The user name the operator's requests carry; the admission policies leave it alone. */}}
{{- define "k8s-rendezvous.operatorUser" -}}
{{- printf "system:serviceaccount:%s:%s" .Release.Namespace (include "k8s-rendezvous.serviceAccountName" .) -}}
{{- end -}}

{{- define "k8s-rendezvous.leaseName" -}}
{{- default (include "k8s-rendezvous.operator" .) .Values.leaderElection.leaseName -}}
{{- end -}}

{{/* Fixed: the handler's error messages and the README name it. */}}
{{- define "k8s-rendezvous.workerRole" -}}
k8s-rendezvous-worker
{{- end -}}

{{/* Fixed: the README and the ClusterRole's own comment name it. */}}
{{- define "k8s-rendezvous.creatorRole" -}}
k8s-rendezvous-creator
{{- end -}}

{{/* The Service in front of the admission webhook (the leader only: see values.yaml). */}}
{{- define "k8s-rendezvous.webhookService" -}}
{{- printf "%s-webhook" (include "k8s-rendezvous.fullname" .) -}}
{{- end -}}

{{/* The Mutating- (and Validating-) WebhookConfiguration kopf keeps up to date; the
operator may patch only objects of this name. */}}
{{- define "k8s-rendezvous.webhookConfig" -}}
{{- printf "%s.k8s-rendezvous.dev" (include "k8s-rendezvous.fullname" .) -}}
{{- end -}}

{{/* The Secret holding the webhook's serving certificate (tls.crt, tls.key, ca.crt), or
nothing: the operator then makes a self-signed one at start. */}}
{{- define "k8s-rendezvous.webhookCertSecret" -}}
{{- $certManager := .Values.webhook.certManager -}}
{{- $existing := .Values.webhook.certificate.existingSecret -}}
{{- if and $certManager.enabled $existing -}}
{{- fail "webhook.certManager.enabled and webhook.certificate.existingSecret both name the webhook's certificate: choose one" -}}
{{- end -}}
{{- if $certManager.enabled -}}
{{- if not $certManager.issuerRef.name -}}
{{- fail "webhook.certManager.enabled needs webhook.certManager.issuerRef.name: the Issuer or ClusterIssuer that signs the webhook's certificate" -}}
{{- end -}}
{{- printf "%s-cert" (include "k8s-rendezvous.webhookService" .) -}}
{{- else -}}
{{- $existing -}}
{{- end -}}
{{- end -}}

{{/* Where the operator container reads that Secret (--webhook-cert-dir). */}}
{{- define "k8s-rendezvous.webhookCertDir" -}}
/etc/k8s-rendezvous/webhook-cert
{{- end -}}
