// kubecheck decodes Kubernetes manifests with the API's own types, strictly: a field the type does
// not have, a field given twice, or a value of the wrong type is an error, as it is for
// `kubectl apply --validate=strict`. It also checks object names, labels, selectors and port
// names with the API machinery's validation rules. Used by tests/deploy/test_k8s_schema.py.
//
//	kubecheck FILE...     prints "ok <apiVersion>/<kind> <name>" per object; exits 1 on any error
//	kubecheck -k DIR...   the same for what kustomize (the library `kubectl apply -k` embeds)
//	                      builds from each kustomization directory
package main

import (
	"bufio"
	"bytes"
	"errors"
	"fmt"
	"io"
	"os"

	monitoringv1 "github.com/prometheus-operator/prometheus-operator/pkg/apis/monitoring/v1"
	appsv1 "k8s.io/api/apps/v1"
	batchv1 "k8s.io/api/batch/v1"
	corev1 "k8s.io/api/core/v1"
	policyv1 "k8s.io/api/policy/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	metavalidation "k8s.io/apimachinery/pkg/apis/meta/v1/validation"
	"k8s.io/apimachinery/pkg/runtime"
	"k8s.io/apimachinery/pkg/runtime/serializer/json"
	"k8s.io/apimachinery/pkg/util/validation"
	"k8s.io/apimachinery/pkg/util/validation/field"
	utilyaml "k8s.io/apimachinery/pkg/util/yaml"
	"sigs.k8s.io/kustomize/api/krusty"
	"sigs.k8s.io/kustomize/kyaml/filesys"
)

func newScheme() (*runtime.Scheme, error) {
	scheme := runtime.NewScheme()
	for _, add := range []func(*runtime.Scheme) error{
		corev1.AddToScheme, appsv1.AddToScheme, batchv1.AddToScheme, policyv1.AddToScheme, monitoringv1.AddToScheme,
	} {
		if err := add(scheme); err != nil {
			return nil, err
		}
	}
	return scheme, nil
}

// documents splits a multi-document YAML file, skipping empty documents.
func documents(data []byte) ([][]byte, error) {
	reader := utilyaml.NewYAMLReader(bufio.NewReader(bytes.NewReader(data)))
	var docs [][]byte
	for {
		doc, err := reader.Read()
		if errors.Is(err, io.EOF) {
			return docs, nil
		}
		if err != nil {
			return nil, err
		}
		if len(bytes.TrimSpace(stripComments(doc))) > 0 {
			docs = append(docs, doc)
		}
	}
}

func stripComments(doc []byte) []byte {
	var out [][]byte
	for _, line := range bytes.Split(doc, []byte("\n")) {
		if t := bytes.TrimSpace(line); len(t) > 0 && t[0] != '#' && !bytes.Equal(t, []byte("---")) {
			out = append(out, line)
		}
	}
	return bytes.Join(out, []byte("\n"))
}

// portNames checks the names of the container ports of a pod template and of a Service's ports.
func portNames(obj runtime.Object) field.ErrorList {
	var errs field.ErrorList
	check := func(name string, path *field.Path) {
		if name == "" {
			return
		}
		for _, msg := range validation.IsValidPortName(name) {
			errs = append(errs, field.Invalid(path, name, msg))
		}
	}
	var spec *corev1.PodSpec
	switch o := obj.(type) {
	case *corev1.Service:
		for i, p := range o.Spec.Ports {
			check(p.Name, field.NewPath("spec", "ports").Index(i).Child("name"))
		}
	case *appsv1.Deployment:
		spec = &o.Spec.Template.Spec
	case *appsv1.StatefulSet:
		spec = &o.Spec.Template.Spec
	case *batchv1.Job:
		spec = &o.Spec.Template.Spec
	}
	if spec != nil {
		for _, c := range append(append([]corev1.Container{}, spec.InitContainers...), spec.Containers...) {
			for i, p := range c.Ports {
				check(p.Name, field.NewPath("spec", "template", "spec", "containers").Key(c.Name).Child("ports").Index(i))
			}
		}
	}
	return errs
}

// selectors checks the label selectors of workloads and Services.
func selectors(obj runtime.Object) field.ErrorList {
	opts := metavalidation.LabelSelectorValidationOptions{}
	switch o := obj.(type) {
	case *corev1.Service:
		return metavalidation.ValidateLabels(o.Spec.Selector, field.NewPath("spec", "selector"))
	case *appsv1.Deployment:
		return metavalidation.ValidateLabelSelector(o.Spec.Selector, opts, field.NewPath("spec", "selector"))
	case *appsv1.StatefulSet:
		return metavalidation.ValidateLabelSelector(o.Spec.Selector, opts, field.NewPath("spec", "selector"))
	case *policyv1.PodDisruptionBudget:
		return metavalidation.ValidateLabelSelector(o.Spec.Selector, opts, field.NewPath("spec", "selector"))
	case *monitoringv1.ServiceMonitor:
		return metavalidation.ValidateLabelSelector(&o.Spec.Selector, opts, field.NewPath("spec", "selector"))
	}
	return nil
}

func checkObject(decoder runtime.Decoder, doc []byte) (string, error) {
	obj, gvk, err := decoder.Decode(doc, nil, nil)
	if err != nil {
		return "", err // strict decoding errors name the unknown or duplicate fields
	}
	accessor, ok := obj.(metav1.Object)
	if !ok {
		return "", fmt.Errorf("%s has no object metadata", gvk)
	}
	name := fmt.Sprintf("%s/%s %s", gvk.GroupVersion(), gvk.Kind, accessor.GetName())
	var errs field.ErrorList
	for _, msg := range validation.IsDNS1123Subdomain(accessor.GetName()) {
		errs = append(errs, field.Invalid(field.NewPath("metadata", "name"), accessor.GetName(), msg))
	}
	if gvk.Kind == "Service" || gvk.Kind == "StatefulSet" { // their names become DNS labels
		for _, msg := range validation.IsDNS1035Label(accessor.GetName()) {
			errs = append(errs, field.Invalid(field.NewPath("metadata", "name"), accessor.GetName(), msg))
		}
	}
	errs = append(errs, metavalidation.ValidateLabels(accessor.GetLabels(), field.NewPath("metadata", "labels"))...)
	errs = append(errs, portNames(obj)...)
	errs = append(errs, selectors(obj)...)
	if len(errs) > 0 {
		return name, errs.ToAggregate()
	}
	return name, nil
}

// read returns the file's bytes, or with kustomize the YAML kustomize builds from the directory.
func read(path string, kustomize bool) ([]byte, error) {
	if !kustomize {
		return os.ReadFile(path)
	}
	resources, err := krusty.MakeKustomizer(krusty.MakeDefaultOptions()).Run(filesys.MakeFsOnDisk(), path)
	if err != nil {
		return nil, err
	}
	return resources.AsYaml()
}

func main() {
	scheme, err := newScheme()
	if err != nil {
		fmt.Fprintln(os.Stderr, err)
		os.Exit(2)
	}
	decoder := json.NewSerializerWithOptions(json.DefaultMetaFactory, scheme, scheme,
		json.SerializerOptions{Yaml: true, Strict: true})
	args, kustomize := os.Args[1:], false
	if len(args) > 0 && args[0] == "-k" {
		args, kustomize = args[1:], true
	}
	failed := false
	for _, path := range args {
		data, err := read(path, kustomize)
		if err != nil {
			fmt.Printf("FAIL %s: %v\n", path, err)
			failed = true
			continue
		}
		docs, err := documents(data)
		if err != nil {
			fmt.Printf("FAIL %s: %v\n", path, err)
			failed = true
			continue
		}
		for i, doc := range docs {
			name, err := checkObject(decoder, doc)
			if err != nil {
				fmt.Printf("FAIL %s (document %d) %s: %v\n", path, i+1, name, err)
				failed = true
			} else {
				fmt.Printf("ok %s\n", name)
			}
		}
	}
	if failed {
		os.Exit(1)
	}
}
